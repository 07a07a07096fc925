"""System checks for a deployment.

The static files manifest check is tagged ``deploy``: without the manifest,
production answers HTTP 500 on every page (``{% static %}`` cannot resolve a name),
so ``check --deploy`` must say so before the server starts. It is not an always-on
check because the commands that come first on a fresh machine (``migrate``, and
``collectstatic`` itself, which runs the staticfiles checks) must not be refused for
want of a file that only ``collectstatic`` writes.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.staticfiles.storage import ManifestFilesMixin
from django.core.checks import Error, Tags, register
from django.core.files.storage import storages

_COLLECT = (
    "Run `python manage.py collectstatic --noinput` in the server's environment "
    "(STATIC_ROOT={root})."
)


def manifest_problem() -> tuple[str, str] | None:
    """Why pages cannot link their static files, as (message, check id), or None.
    Only a storage that serves hashed names needs the manifest collectstatic writes."""
    backend = settings.STORAGES["staticfiles"]["BACKEND"]
    try:
        storage = storages["staticfiles"]
    except ValueError as exc:  # the manifest exists but is not one
        return f"The static files manifest cannot be read: {exc}", "portal.E002"
    if not isinstance(storage, ManifestFilesMixin):
        return None
    if storage.manifest_storage.exists(storage.manifest_name):
        return None
    manifest = storage.manifest_storage.path(storage.manifest_name)
    return (
        f"The static files manifest {manifest} is missing: with {backend}, every "
        "page would answer HTTP 500.",
        "portal.E001",
    )


@register(Tags.staticfiles, deploy=True)
def static_files_manifest_exists(app_configs, **kwargs) -> list[Error]:
    """A storage that serves hashed names needs the manifest that collectstatic writes."""
    problem = manifest_problem()
    if problem is None:
        return []
    message, check_id = problem
    return [Error(message, hint=_COLLECT.format(root=settings.STATIC_ROOT), id=check_id)]

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


@register(Tags.staticfiles, deploy=True)
def static_files_manifest_exists(app_configs, **kwargs) -> list[Error]:
    """A storage that serves hashed names needs the manifest that collectstatic writes."""
    backend = settings.STORAGES["staticfiles"]["BACKEND"]
    hint = _COLLECT.format(root=settings.STATIC_ROOT)
    try:
        storage = storages["staticfiles"]
    except ValueError as exc:  # the manifest exists but is not one
        return [
            Error(f"The static files manifest cannot be read: {exc}", hint=hint, id="portal.E002")
        ]
    if not isinstance(storage, ManifestFilesMixin):
        return []
    if storage.manifest_storage.exists(storage.manifest_name):
        return []
    manifest = storage.manifest_storage.path(storage.manifest_name)
    return [
        Error(
            f"The static files manifest {manifest} is missing: with {backend}, every "
            "page would answer HTTP 500.",
            hint=hint,
            id="portal.E001",
        )
    ]

"""System checks for a deployment.

``/metrics`` (``portal.metrics``) is checked for a deployment too: it must not be
open to the whole internet.

The static files manifest check is tagged ``deploy``: without the manifest,
production answers HTTP 500 on every page (``{% static %}`` cannot resolve a name),
so ``check --deploy`` must say so before the server starts. It is not an always-on
check because the commands that come first on a fresh machine (``migrate``, and
``collectstatic`` itself, which runs the staticfiles checks) must not be refused for
want of a file that only ``collectstatic`` writes.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.contrib.staticfiles.storage import ManifestFilesMixin
from django.core.checks import Error, Tags, Warning, register
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


# A token Prometheus sends on every scrape: long enough that guessing is hopeless.
METRICS_TOKEN_MIN_LENGTH = 32


@register(Tags.security, deploy=True)
def metrics_not_public(app_configs, **kwargs) -> list[Warning]:
    """``/metrics`` shows how busy each lab is and how the portal's work goes; it is for
    the operator's monitoring, not for everyone who can reach the portal."""
    token = settings.PORTAL_METRICS_TOKEN
    networks = [
        ipaddress.ip_network(cidr.strip(), strict=False)
        for cidr in settings.PORTAL_METRICS_ALLOWED_NETWORKS
    ]
    found = []
    if not token and any(network.prefixlen == 0 for network in networks):
        found.append(
            Warning(
                "PORTAL_METRICS_ALLOWED_NETWORKS includes every address (a /0 network) "
                "and PORTAL_METRICS_TOKEN is not set, so anyone can read /metrics.",
                hint="List only the networks Prometheus scrapes from, or set "
                "PORTAL_METRICS_TOKEN (or PORTAL_METRICS_TOKEN_FILE) as well.",
                id="portal.W001",
            )
        )
    if token and len(token) < METRICS_TOKEN_MIN_LENGTH:
        found.append(
            Warning(
                f"PORTAL_METRICS_TOKEN is shorter than {METRICS_TOKEN_MIN_LENGTH} characters.",
                hint="Use a random one: "
                'python -c "import secrets; print(secrets.token_urlsafe(32))"',
                id="portal.W002",
            )
        )
    return found

"""System checks for the settings that keep the portal's SSH inside its own networks,
and for the key that opens the labs' SSH keys. ``manage.py check --deploy`` runs the
deploy ones."""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError


def _networks() -> tuple[list, list[str]]:
    parsed, bad = [], []
    for text in settings.PORTAL_REMOTE_ALLOWED_NETWORKS:
        try:
            parsed.append(ipaddress.ip_network(text))
        except ValueError:
            bad.append(text)
    return parsed, bad


@register(Tags.security)
def check_remote_networks_parse(app_configs, **kwargs):
    """A network the SSH layer cannot read would refuse every worker at run time."""
    _, bad = _networks()
    return [
        Error(
            f"PORTAL_REMOTE_ALLOWED_NETWORKS: {text!r} is not a network in CIDR form "
            "(such as 10.128.0.0/9 or 34.0.0.0/8, with no host bits set).",
            id="tpus.E002",
        )
        for text in bad
    ]


@register(Tags.security, deploy=True)
def check_remote_networks_set(app_configs, **kwargs):
    """In production the portal's root-capable SSH may only reach the labs' TPU VMs:
    an empty list (or one that spans every address) lets a registered address aim it
    at any host the portal can reach, internal services included."""
    parsed, _ = _networks()
    if not settings.PORTAL_REMOTE_ALLOWED_NETWORKS:
        return [
            Error(
                "PORTAL_REMOTE_ALLOWED_NETWORKS is empty, so the portal would SSH to any "
                "address a TPU VM record names.",
                hint="Set it to the CIDRs of the labs' TPU VMs (comma-separated), for "
                "example the VPC ranges or the external ranges they use.",
                id="tpus.E001",
            )
        ]
    if any(network.prefixlen == 0 for network in parsed):
        return [
            Error(
                "PORTAL_REMOTE_ALLOWED_NETWORKS includes every address (a /0 network), "
                "so it limits nothing.",
                hint="List only the CIDRs of the labs' TPU VMs.",
                id="tpus.E003",
            )
        ]
    return []


@register(Tags.security, deploy=True)
def check_lab_keys_readable(app_configs, **kwargs):
    """Every lab's SSH private key opens with the configured keys: a changed
    PORTAL_SECRETS_KEY without the old one in PORTAL_SECRETS_OLD_KEYS would fail every
    reconcile, revoke and job of those labs. A deploy check, because it reads the
    database (and ``rotate_secrets``, the way out, must never be refused)."""
    from tpus.services import labkeys

    try:
        unreadable = labkeys.unreadable_keys()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), id="tpus.E005")]
    except DatabaseError:
        return []  # no database yet (or not migrated): nothing stored to read
    if not unreadable:
        return []
    return [
        Error(
            f"The SSH private key of {unreadable} lab(s) {labkeys.UNREADABLE_ADVICE}",
            id="tpus.E004",
        )
    ]

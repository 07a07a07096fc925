"""Who may read ``/metrics``: not the public. A bearer token
(``PORTAL_METRICS_TOKEN``), an allowed network (``PORTAL_METRICS_ALLOWED_NETWORKS``),
or both, each that is set must pass; with neither set the endpoint is off. The
client's address is the one ``portal.addresses`` gives, so a scrape through the
portal's own proxies (``PORTAL_TRUSTED_PROXIES``) counts from where it came."""

from __future__ import annotations

import hmac
from enum import Enum

from django.conf import settings

from portal.addresses import client_ip, parse_address, trusted_networks, within


class Verdict(Enum):
    OFF = "off"  # neither setting: answered as if there were no such page
    UNAUTHENTICATED = "unauthenticated"  # the token is missing or wrong
    OUTSIDE = "outside"  # the client's address is outside the allowed networks
    ALLOWED = "allowed"


def enabled() -> bool:
    return bool(settings.PORTAL_METRICS_TOKEN or settings.PORTAL_METRICS_ALLOWED_NETWORKS)


def verdict(request) -> Verdict:
    if not enabled():
        return Verdict.OFF
    token = settings.PORTAL_METRICS_TOKEN
    if token and not _token_matches(request, token):
        return Verdict.UNAUTHENTICATED
    cidrs = tuple(settings.PORTAL_METRICS_ALLOWED_NETWORKS)
    if cidrs:
        address = parse_address(client_ip(request) or "")
        if address is None or not within(address, trusted_networks(cidrs)):
            return Verdict.OUTSIDE
    return Verdict.ALLOWED


def _token_matches(request, token: str) -> bool:
    scheme, _, given = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())

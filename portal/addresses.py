"""The address a request came from, also behind the portal's own proxies.

Behind a TLS proxy every request reaches gunicorn from the proxy's address, and the
client's is in ``X-Forwarded-For``, which anyone can also send. So the header is read
only when the direct peer is one of ``PORTAL_TRUSTED_PROXIES``, and from the right:
each trusted proxy appends the address it saw, so the right-most hop that is not a
trusted proxy is the client; what lies left of it is the client's own say.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from django.conf import settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def client_ip(request) -> str | None:
    """The client's address as text, or None when the request has none."""
    if request is None:
        return None
    peer = parse_address(request.META.get("REMOTE_ADDR", ""))
    if peer is None:
        return None
    trusted = trusted_networks(tuple(settings.PORTAL_TRUSTED_PROXIES))
    if not within(peer, trusted):
        return str(peer)
    client = peer
    hops = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
    for hop in reversed(hops):
        address = parse_address(hop)
        if address is None:
            # A hop no proxy of ours wrote: stop at the last one we can vouch for.
            break
        client = address
        if not within(address, trusted):
            break
    return str(client)


def parse_address(text: str) -> Address | None:
    """An address as proxies write it (``203.0.113.5``, ``203.0.113.5:51234``,
    ``[2001:db8::1]:443``, ``2001:db8::1``), IPv4-mapped IPv6 as IPv4; None if it is
    not one."""
    text = (text or "").strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


@lru_cache(maxsize=8)
def trusted_networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    """A setting's CIDRs as networks (the settings module has checked each)."""
    return tuple(ipaddress.ip_network(cidr.strip(), strict=False) for cidr in cidrs)


def check_trusted_proxies(cidrs: list[str]) -> list[str]:
    """The setting as given, or ImproperlyConfigured naming the value that is no CIDR."""
    return check_networks("PORTAL_TRUSTED_PROXIES", cidrs)


def check_networks(setting: str, cidrs: list[str]) -> list[str]:
    """A setting's addresses or CIDRs as given, or ImproperlyConfigured naming the
    value that is neither."""
    from django.core.exceptions import ImproperlyConfigured

    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr.strip(), strict=False)
        except ValueError:
            raise ImproperlyConfigured(
                f"{setting}: {cidr!r} is not an address or a network "
                "(such as 127.0.0.1 or 10.0.0.0/8)."
            ) from None
    return cidrs


def within(address: Address, networks: tuple[Network, ...]) -> bool:
    """Whether the address lies in one of the networks."""
    return any(address.version == net.version and address in net for net in networks)

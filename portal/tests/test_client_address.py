"""Where a request came from, behind the portal's own proxies (PORTAL_TRUSTED_PROXIES):
X-Forwarded-For counts only when a trusted proxy sent it, read from the right."""

from __future__ import annotations

import pytest
from allauth.account.adapter import get_adapter
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory

from portal.addresses import check_trusted_proxies, client_ip


def request_from(peer: str, forwarded: str | None = None):
    extra = {"REMOTE_ADDR": peer}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return RequestFactory().get("/", **extra)


def test_without_trusted_proxies_the_header_is_ignored(settings):
    settings.PORTAL_TRUSTED_PROXIES = []
    assert client_ip(request_from("198.51.100.7", "203.0.113.5")) == "198.51.100.7"


def test_a_trusted_proxy_passes_on_the_address_it_saw(settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    assert client_ip(request_from("127.0.0.1", "203.0.113.5")) == "203.0.113.5"


def test_an_address_the_client_wrote_itself_is_not_believed(settings):
    # The client sent "X-Forwarded-For: 10.9.9.9"; the proxy appended what it saw.
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    assert client_ip(request_from("127.0.0.1", "10.9.9.9, 203.0.113.5")) == "203.0.113.5"


def test_a_chain_of_trusted_proxies_is_walked_to_the_first_untrusted_hop(settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1", "10.0.0.0/8"]
    forwarded = "1.2.3.4, 203.0.113.5, 10.1.2.3"
    assert client_ip(request_from("127.0.0.1", forwarded)) == "203.0.113.5"


def test_a_request_straight_from_elsewhere_is_that_address_whatever_it_claims(settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    assert client_ip(request_from("198.51.100.7", "127.0.0.1")) == "198.51.100.7"


def test_a_malformed_hop_stops_the_walk_at_the_last_trusted_proxy(settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1", "10.0.0.0/8"]
    assert client_ip(request_from("127.0.0.1", "203.0.113.5, junk, 10.1.2.3")) == "10.1.2.3"


@pytest.mark.parametrize(
    "hop, seen",
    [
        ("203.0.113.5:51234", "203.0.113.5"),
        ("[2001:db8::1]:443", "2001:db8::1"),
        ("2001:db8::1", "2001:db8::1"),
        ("::ffff:203.0.113.5", "203.0.113.5"),
    ],
)
def test_ports_brackets_and_mapped_addresses_are_read(settings, hop, seen):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    assert client_ip(request_from("127.0.0.1", hop)) == seen


def test_allauth_counts_its_rate_limits_per_the_same_address(settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    request = request_from("127.0.0.1", "10.9.9.9, 203.0.113.5")
    assert get_adapter(request).get_client_ip(request) == "203.0.113.5"


def test_a_setting_that_is_no_network_stops_the_start(settings):
    with pytest.raises(ImproperlyConfigured, match="'10.0.0.0/33'"):
        check_trusted_proxies(["127.0.0.1", "10.0.0.0/33"])

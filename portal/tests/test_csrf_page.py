"""A form Django refuses as a possible cross-site request lands on the portal's own
page (its layout, signed in as the person), says what most likely happened and what
to do, answers 403, and changes nothing."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import SSHKey
from accounts.tests import keydata


@pytest.fixture
def milo(make_user):
    return make_user("milo@uni.example")


@pytest.fixture
def strict(milo) -> Client:
    """A browser that Django checks for CSRF as it checks a real one."""
    client = Client(enforce_csrf_checks=True)
    client.force_login(milo)
    client.get(reverse("key_list"))  # sets the CSRF cookie, as loading the page does
    return client


def _token(client: Client) -> str:
    page = client.get(reverse("key_list")).content.decode()
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]


def _post_key(client: Client, token: str, **headers):
    data = {"key_text": keydata.ED25519, "label": "laptop", "csrfmiddlewaretoken": token}
    return client.post(reverse("key_list"), data, **headers)


def _assert_portal_page(response, kind: str) -> str:
    body = response.content.decode()
    assert response.status_code == 403
    assert "<h1>The portal did not accept this form</h1>" in body
    assert f'data-csrf-reason="{kind}"' in body
    # The portal's layout, signed in: its stylesheet and the person's own menu.
    assert re.search(r'<link rel="stylesheet" href="/static/[^"]+\.css"', body)
    assert "milo@uni.example" in body
    assert "CSRF verification failed" not in body  # not Django's yellow page
    return body


def test_a_form_from_a_page_left_open_too_long_gets_the_portals_page_and_changes_nothing(
    strict, milo
):
    response = _post_key(strict, "x" * 64)
    body = _assert_portal_page(response, "stale")
    assert "load the page again" in body
    assert not SSHKey.objects.filter(user=milo).exists()


def test_the_same_form_with_its_token_is_accepted(strict, milo):
    response = _post_key(strict, _token(strict))
    assert response.status_code in (200, 302)
    assert SSHKey.objects.filter(user=milo).count() == 1


def test_a_form_without_the_cookie_says_to_allow_cookies(milo):
    client = Client(enforce_csrf_checks=True)
    client.force_login(milo)
    body = _assert_portal_page(_post_key(client, "x" * 64), "cookie")
    assert "Allow cookies" in body
    assert not SSHKey.objects.filter(user=milo).exists()


def test_a_proxy_that_drops_origin_and_referer_over_https_is_named(strict, milo, settings):
    token = _token(strict)
    response = _post_key(strict, token, secure=True)
    body = _assert_portal_page(response, "referer")
    assert "proxy" in body
    assert not SSHKey.objects.filter(user=milo).exists()


def test_a_form_sent_from_another_site_is_refused_on_the_portals_page(strict, milo):
    token = _token(strict)
    response = _post_key(strict, token, HTTP_ORIGIN="https://evil.example")
    _assert_portal_page(response, "origin")
    assert not SSHKey.objects.filter(user=milo).exists()

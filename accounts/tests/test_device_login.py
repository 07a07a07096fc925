"""Signing in a command-line client through the browser (``tpu login``, RFC 8628): a
code for the device, approval on the portal with the person's password or
authenticator code, one token to the device, and every refusal on the way."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from allauth.mfa.totp.internal.auth import (
    TOTP,
    format_hotp_value,
    generate_totp_secret,
    hotp_value,
)
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiToken, DeviceAuthorization, hash_token

PASSWORD = "correct horse battery"


@pytest.fixture
def milo(make_user):
    return make_user("milo@uni.example", password=PASSWORD)


@pytest.fixture
def browser(client, milo):
    client.force_login(milo)
    return client


def start(client, name="milo-laptop", **extra):
    return client.post(
        "/api/v1/device/codes", {"device_name": name}, content_type="application/json", **extra
    )


def poll(device_code: str):
    """A poll as the client makes it, the interval kept (the last poll moved back)."""
    DeviceAuthorization.objects.filter(device_digest=hash_token(device_code)).update(
        last_polled_at=timezone.now() - dt.timedelta(seconds=60)
    )
    return Client().post(
        "/api/v1/device/token", {"device_code": device_code}, content_type="application/json"
    )


def approve(browser, user_code: str, **fields):
    data = {"code": user_code, "action": "approve", "password": PASSWORD, **fields}
    return browser.post(reverse("device_login"), data)


def test_a_device_approved_in_the_browser_gets_one_token_of_that_person(browser, milo):
    answer = start(Client())
    assert answer.status_code == 201
    body = answer.json()
    assert body["verification_uri"] == "http://testserver/device/"
    assert (
        body["verification_uri_complete"] == f"http://testserver/device/?code={body['user_code']}"
    )
    assert body["expires_in"] == 600 and body["interval"] == 5
    assert len(body["user_code"]) == 9 and body["user_code"][4] == "-"
    # Only the device code's hash is kept.
    row = DeviceAuthorization.objects.get()
    assert body["device_code"] not in row.device_digest
    assert row.device_digest == hash_token(body["device_code"])

    assert poll(body["device_code"]).json()["error"] == "authorization_pending"

    page = browser.get(reverse("device_login"), {"code": body["user_code"]})
    text = page.content.decode()
    assert "milo-laptop" in text and body["user_code"] in text
    assert 'name="password"' in text and 'name="totp_code"' not in text

    done = approve(browser, body["user_code"])
    assert done.status_code == 200
    assert "is signed in as milo@uni.example" in done.content.decode()

    issued = poll(body["device_code"])
    assert issued.status_code == 200
    token = issued.json()["token"]
    assert issued.json()["email"] == "milo@uni.example"
    me = Client().get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert me.status_code == 200 and me.json()["email"] == "milo@uni.example"
    assert ApiToken.objects.get(user=milo).name == "milo-laptop"

    again = poll(body["device_code"])
    assert again.status_code == 400 and again.json()["error"] == "expired_token"
    assert ApiToken.objects.filter(user=milo).count() == 1


def test_a_device_that_polls_too_fast_is_told_to_slow_down_and_its_interval_grows(browser):
    code = start(Client()).json()["device_code"]
    first = Client().post(
        "/api/v1/device/token", {"device_code": code}, content_type="application/json"
    )
    assert first.json()["error"] == "authorization_pending"
    second = Client().post(
        "/api/v1/device/token", {"device_code": code}, content_type="application/json"
    )
    assert second.status_code == 400
    assert second.json() == {
        "error": "slow_down",
        "detail": "Polling too fast: wait 10 seconds between polls.",
    }
    assert DeviceAuthorization.objects.get().interval == 10


def test_a_wrong_password_approves_nothing(browser, milo):
    body = start(Client()).json()
    refused = approve(browser, body["user_code"], password="not it")
    assert refused.status_code == 400
    assert "That is not your password." in refused.content.decode()
    assert DeviceAuthorization.objects.get().state == "pending"
    assert poll(body["device_code"]).json()["error"] == "authorization_pending"
    assert not ApiToken.objects.filter(user=milo).exists()


def test_a_person_with_an_authenticator_app_confirms_with_its_code(browser, milo):
    secret = generate_totp_secret()
    TOTP.activate(milo, secret)
    body = start(Client()).json()
    page = browser.get(reverse("device_login"), {"code": body["user_code"]}).content.decode()
    assert 'name="totp_code"' in page and 'name="password"' not in page

    refused = approve(browser, body["user_code"], totp_code="000000")
    assert refused.status_code == 400
    assert "not the current code" in refused.content.decode()
    # The password alone is not enough once an authenticator app is set up.
    assert approve(browser, body["user_code"]).status_code == 400

    current = format_hotp_value(hotp_value(secret, int(time.time()) // 30))
    assert approve(browser, body["user_code"], totp_code=current).status_code == 200
    assert poll(body["device_code"]).status_code == 200


def test_a_denied_device_is_told_so_and_gets_nothing(browser, milo):
    body = start(Client()).json()
    denied = browser.post(reverse("device_login"), {"code": body["user_code"], "action": "deny"})
    assert "gets no token" in denied.content.decode()
    answer = poll(body["device_code"])
    assert answer.status_code == 400 and answer.json()["error"] == "access_denied"
    assert not ApiToken.objects.filter(user=milo).exists()
    # The code cannot be approved after all.
    assert "already been used" in approve(browser, body["user_code"]).content.decode()


def test_an_expired_code_cannot_be_approved_and_its_device_must_start_again(browser):
    body = start(Client()).json()
    DeviceAuthorization.objects.update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    page = browser.get(reverse("device_login"), {"code": body["user_code"]}).content.decode()
    assert "That code has expired" in page
    assert approve(browser, body["user_code"]).status_code == 400
    assert poll(body["device_code"]).json()["error"] == "expired_token"


def test_codes_are_typed_in_any_case_with_or_without_the_dash(browser):
    body = start(Client()).json()
    typed = body["user_code"].replace("-", " ").lower()
    page = browser.get(reverse("device_login"), {"code": typed}).content.decode()
    assert "milo-laptop" in page


@pytest.mark.parametrize(
    "name, message",
    [
        ("", "Name the device"),
        ("x" * 101, "at most 100 characters"),
        ("laptop\x1b[31m", "Control characters (U+001B)"),
    ],
)
def test_a_bad_device_name_is_refused_and_nothing_is_stored(db, name, message):
    answer = start(Client(), name)
    assert answer.status_code == 400
    assert message in answer.json()["detail"]
    assert not DeviceAuthorization.objects.exists()


def test_one_address_may_ask_for_a_bounded_number_of_codes(db):
    client = Client()
    for _ in range(30):
        assert start(client).status_code == 201
    refused = start(client)
    assert refused.status_code == 400
    assert "Too many sign-in codes" in refused.json()["detail"]
    # Another address is not held up.
    assert start(Client(REMOTE_ADDR="198.51.100.9")).status_code == 201


def test_the_device_page_asks_to_sign_in_first_and_comes_back_with_the_code(client):
    page = client.get(reverse("device_login"), {"code": "WDJB-MJHT"})
    assert page.status_code == 302
    assert page["Location"].startswith("/accounts/login/?next=/device/%3Fcode%3DWDJB-MJHT")


def test_the_token_is_the_approvers_whoever_started_the_sign_in(browser, milo, make_user):
    body = start(Client()).json()
    other = Client()
    other.force_login(make_user("ann@uni.example", password=PASSWORD))
    assert approve(other, body["user_code"]).status_code == 200
    issued = poll(body["device_code"]).json()
    assert issued["email"] == "ann@uni.example"
    assert not ApiToken.objects.filter(user=milo).exists()


def test_logout_revokes_the_token_it_carries_and_no_other(milo):
    from accounts.services import create_token

    _, raw = create_token(milo, "laptop")
    _, other = create_token(milo, "ci")
    gone = Client().delete("/api/v1/tokens/current", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert gone.status_code == 204
    assert Client().get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401
    assert Client().get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {other}").status_code == 200


def test_a_browser_session_has_no_current_token_to_revoke(browser):
    token = browser.get(reverse("token_list")).cookies["csrftoken"].value
    answer = browser.delete("/api/v1/tokens/current", HTTP_X_CSRFTOKEN=token)
    assert answer.status_code == 400

"""The device page's guards: wrong codes (per person and per client address, behind
the proxy the address it forwarded) and the password or authenticator confirmation,
throttled as allauth throttles its own sign-in forms. Past a limit nothing is
checked: the right code or password is refused as well."""

from __future__ import annotations

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

from accounts.models import ApiToken, DeviceAuthorization

PASSWORD = "correct horse battery"
WRONG = "BCDF-GHJK"  # no device waits with it


@pytest.fixture
def milo(make_user):
    return make_user("milo@uni.example", password=PASSWORD)


def browser_of(user, address="127.0.0.1") -> Client:
    client = Client(REMOTE_ADDR=address)
    client.force_login(user)
    return client


def new_code(name="milo-laptop") -> dict:
    return (
        Client()
        .post("/api/v1/device/codes", {"device_name": name}, content_type="application/json")
        .json()
    )


def look_up(client, code) -> str:
    return client.get(reverse("device_login"), {"code": code}).content.decode()


def wrong_codes(client, count: int) -> None:
    for _ in range(count):
        assert "No device is waiting with that code" in look_up(client, WRONG)


@pytest.fixture
def low_limits(settings):
    settings.ACCOUNT_RATE_LIMITS = {
        **settings.ACCOUNT_RATE_LIMITS,
        "device_code_wrong": "3/10m/user,5/10m/ip",
    }


@pytest.mark.parametrize("wrong", [12, 15])
def test_past_the_limit_the_right_code_is_refused_too(milo, wrong):
    browser = browser_of(milo)
    wrong_codes(browser, 10)
    for _ in range(wrong - 10):
        assert "Too many wrong codes" in look_up(browser, WRONG)
    code = new_code()["user_code"]
    page = look_up(browser, code)
    assert "Too many wrong codes" in page and "milo-laptop" not in page
    # Approving it straight away is refused the same way, and the device gets nothing.
    answer = browser.post(
        reverse("device_login"), {"code": code, "action": "approve", "password": PASSWORD}
    )
    assert answer.status_code == 400 and "Too many wrong codes" in answer.content.decode()
    assert DeviceAuthorization.objects.get().state == "pending"


def test_wrong_codes_count_against_the_person_from_any_address(milo, low_limits):
    wrong_codes(browser_of(milo, "198.51.100.1"), 3)
    code = new_code()["user_code"]
    assert "Too many wrong codes" in look_up(browser_of(milo, "198.51.100.2"), code)


def test_wrong_codes_count_against_the_address_whoever_types_them(milo, make_user, low_limits):
    ann = make_user("ann@uni.example", password=PASSWORD)
    wrong_codes(browser_of(milo, "198.51.100.1"), 3)
    wrong_codes(browser_of(ann, "198.51.100.1"), 2)
    code = new_code()["user_code"]
    # A third person on that address is refused; Ann elsewhere is not.
    zoe = make_user("zoe@uni.example", password=PASSWORD)
    assert "Too many wrong codes" in look_up(browser_of(zoe, "198.51.100.1"), code)
    assert "milo-laptop" in look_up(browser_of(ann, "198.51.100.2"), code)


def test_behind_the_proxy_wrong_codes_count_per_forwarded_address(
    milo, make_user, low_limits, settings
):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    ann = make_user("ann@uni.example", password=PASSWORD)
    zoe = make_user("zoe@uni.example", password=PASSWORD)

    def via_proxy(user, address):
        client = Client(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR=address)
        client.force_login(user)
        return client

    wrong_codes(via_proxy(milo, "203.0.113.1"), 3)
    wrong_codes(via_proxy(ann, "203.0.113.1"), 2)
    code = new_code()["user_code"]
    assert "Too many wrong codes" in look_up(via_proxy(zoe, "203.0.113.1"), code)
    # Everyone else behind the same proxy is not locked out by them.
    assert "milo-laptop" in look_up(via_proxy(zoe, "203.0.113.2"), code)


def confirm(client, code, **fields):
    data = {"code": code, "action": "approve", **fields}
    return client.post(reverse("device_login"), data)


def test_wrong_passwords_stop_being_checked_as_allauths_sign_in_stops(milo):
    browser = browser_of(milo)
    body = new_code()
    for _ in range(5):
        answer = confirm(browser, body["user_code"], password="not it")
        assert "That is not your password." in answer.content.decode()
    for _ in range(20):
        answer = confirm(browser, body["user_code"], password="not it")
        assert "Too many wrong confirmations" in answer.content.decode()
    answer = confirm(browser, body["user_code"], password=PASSWORD)
    assert answer.status_code == 400 and "Too many wrong confirmations" in answer.content.decode()
    assert DeviceAuthorization.objects.get().state == "pending"
    assert not ApiToken.objects.exists()
    # The count is allauth's own: its sign-in form refuses the right password too.
    login = Client().post(
        reverse("account_login"), {"login": "milo@uni.example", "password": PASSWORD}
    )
    assert "Too many failed login attempts" in login.content.decode()


def test_a_right_password_takes_back_its_own_attempt(milo):
    browser = browser_of(milo)
    for _ in range(6):
        body = new_code()
        assert confirm(browser, body["user_code"], password=PASSWORD).status_code == 200


def test_wrong_authenticator_codes_stop_being_checked(milo):
    secret = generate_totp_secret()
    TOTP.activate(milo, secret)
    browser = browser_of(milo)
    body = new_code()
    for _ in range(5):
        answer = confirm(browser, body["user_code"], totp_code="000000")
        assert "not the current code" in answer.content.decode()
    current = format_hotp_value(hotp_value(secret, int(time.time()) // 30))
    answer = confirm(browser, body["user_code"], totp_code=current)
    assert answer.status_code == 400 and "Too many wrong confirmations" in answer.content.decode()
    assert DeviceAuthorization.objects.get().state == "pending"

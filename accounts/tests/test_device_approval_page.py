"""What the person sees and is told around a device sign-in: the approval page says
where and when the code was asked for and warns when the code came in a link; the
person is emailed when a device gets a token of theirs."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiToken, DeviceAuthorization, hash_token
from portal.models import OutboxMessage

PASSWORD = "correct horse battery"


@pytest.fixture
def milo(make_user):
    return make_user("milo@uni.example", password=PASSWORD)


@pytest.fixture
def browser(milo):
    client = Client(REMOTE_ADDR="198.51.100.20")
    client.force_login(milo)
    return client


def start(**extra) -> dict:
    client = Client(**extra)
    answer = client.post(
        "/api/v1/device/codes", {"device_name": "milo-laptop"}, content_type="application/json"
    )
    return answer.json()


def poll(device_code: str):
    DeviceAuthorization.objects.filter(device_digest=hash_token(device_code)).update(
        last_polled_at=timezone.now() - dt.timedelta(seconds=60)
    )
    return Client().post(
        "/api/v1/device/token", {"device_code": device_code}, content_type="application/json"
    )


def test_a_code_from_a_link_is_warned_about(browser):
    body = start(REMOTE_ADDR="203.0.113.8")
    page = browser.get(reverse("device_login"), {"code": body["user_code"]}).content.decode()
    assert 'id="link-warning"' in page
    assert "You opened this page from a link that filled in the code" in page
    assert 'name="from_link" value="1"' in page


def test_a_typed_code_is_not_warned_about(browser):
    body = start()
    entry = browser.get(reverse("device_login")).content.decode()
    assert '<form method="post">' in entry and 'name="code"' in entry
    page = browser.post(reverse("device_login"), {"code": body["user_code"]})
    assert page.status_code == 200
    text = page.content.decode()
    assert "milo-laptop" in text and 'id="link-warning"' not in text


def test_the_warning_stays_after_a_wrong_password(browser):
    body = start()
    answer = browser.post(
        reverse("device_login"),
        {"code": body["user_code"], "action": "approve", "password": "no", "from_link": "1"},
    )
    assert answer.status_code == 400
    assert 'id="link-warning"' in answer.content.decode()


def test_the_page_says_where_and_when_the_code_was_asked_for(browser):
    body = start(REMOTE_ADDR="203.0.113.8")
    row = DeviceAuthorization.objects.get()
    page = browser.get(reverse("device_login"), {"code": body["user_code"]}).content.decode()
    assert row.created_at.strftime("%-d %b %Y %H:%M:%S") + " UTC" in page
    assert "<code>203.0.113.8</code>" in page
    assert "this browser is at <code>198.51.100.20</code>" in page


def test_behind_the_proxy_the_page_shows_the_clients_own_address(browser, settings):
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    body = start(REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="10.0.0.1, 203.0.113.8")
    assert DeviceAuthorization.objects.get().requested_from == "203.0.113.8"
    page = browser.get(reverse("device_login"), {"code": body["user_code"]}).content.decode()
    assert "<code>203.0.113.8</code>" in page


def test_the_person_is_emailed_when_a_device_gets_a_token(
    browser, milo, settings, django_capture_on_commit_callbacks
):
    body = start(REMOTE_ADDR="203.0.113.8")
    browser.post(
        reverse("device_login"),
        {"code": body["user_code"], "action": "approve", "password": PASSWORD},
    )
    assert not OutboxMessage.objects.exists()  # approving alone gives nothing yet
    with django_capture_on_commit_callbacks(execute=True):
        assert poll(body["device_code"]).status_code == 200
    token = ApiToken.objects.get(user=milo)
    [message] = mail.outbox
    assert message.to == ["milo@uni.example"]
    assert "A device signed in as you: milo-laptop" in message.subject
    assert '"milo-laptop"' in message.body and "from 203.0.113.8" in message.body
    assert token.created_at.strftime("%-d %b %Y %H:%M") in message.body
    assert token.expires_at.strftime("%-d %b %Y %H:%M") in message.body
    assert token.hint in message.body
    assert settings.SITE_URL + reverse("token_list") in message.body
    # One email per token: a second poll gets nothing and sends nothing.
    poll(body["device_code"])
    assert OutboxMessage.objects.count() == 1

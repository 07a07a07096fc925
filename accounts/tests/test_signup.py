"""Sign-up with a verified email, sign-in, password reset, and the rate limits."""

from __future__ import annotations

import re

import pytest
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from accounts.models import User
from portal import outbox
from portal.models import OutboxMessage, OutboxState


def _link(message) -> str:
    return re.search(r"http://testserver(/\S+)", message.body).group(1)


def test_signup_needs_the_emailed_link_before_signing_in(
    client, db, django_capture_on_commit_callbacks
):
    # The email goes to the outbox and out once the sign-up commits.
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("account_signup"),
            {
                "email": "Milo@Uni.example",
                "password1": "a long passphrase 42",
                "password2": "a long passphrase 42",
            },
        )
    assert response.status_code == 302
    user = User.objects.get()
    assert user.email == "milo@uni.example"
    assert len(mail.outbox) == 1
    # Not verified yet: signing in leads back to "verify your email".
    client.logout()
    client.post(
        reverse("account_login"), {"login": "milo@uni.example", "password": "a long passphrase 42"}
    )
    assert client.get(reverse("dashboard")).status_code == 302
    confirm = _link(mail.outbox[-1])
    assert client.post(confirm).status_code == 302
    client.post(
        reverse("account_login"), {"login": "milo@uni.example", "password": "a long passphrase 42"}
    )
    assert client.get(reverse("dashboard")).status_code == 200


def test_a_weak_password_is_refused(client, db):
    response = client.post(
        reverse("account_signup"),
        {"email": "milo@uni.example", "password1": "12345678", "password2": "12345678"},
    )
    assert response.status_code == 200
    assert not User.objects.exists()


def test_the_same_email_cannot_sign_up_twice_in_another_case(client, make_user):
    make_user("milo@uni.example")
    client.post(
        reverse("account_signup"),
        {
            "email": "MILO@uni.example",
            "password1": "a long passphrase 42",
            "password2": "a long passphrase 42",
        },
    )
    assert User.objects.filter(email__iexact="milo@uni.example").count() == 1


def test_password_reset_mails_a_working_link(client, make_user, django_capture_on_commit_callbacks):
    make_user("milo@uni.example", password="old passphrase 1")
    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("account_reset_password"), {"email": "milo@uni.example"})
    link = _link(mail.outbox[-1])
    response = client.get(link, follow=True)
    form_url = response.redirect_chain[-1][0] if response.redirect_chain else link
    client.post(form_url, {"password1": "new passphrase 22", "password2": "new passphrase 22"})
    assert client.login(email="milo@uni.example", password="new passphrase 22")


def test_failed_logins_are_rate_limited_in_the_shared_cache(client, make_user):
    make_user("milo@uni.example", password="right passphrase")
    pages = [
        client.post(
            reverse("account_login"), {"login": "milo@uni.example", "password": f"wrong {i}"}
        ).content.decode()
        for i in range(6)
    ]
    assert "Too many failed login attempts" not in pages[0]
    assert "Too many failed login attempts" in pages[-1]
    # Even the right password waits until the limit passes.
    response = client.post(
        reverse("account_login"), {"login": "milo@uni.example", "password": "right passphrase"}
    )
    assert "Too many failed login attempts" in response.content.decode()
    assert client.get(reverse("dashboard")).status_code == 302


def test_the_cache_is_shared_between_processes(settings):
    assert "locmem" not in settings.CACHES["default"]["BACKEND"]


@pytest.mark.django_db(transaction=True)
def test_signing_up_while_smtp_refuses_works_and_the_verification_mail_follows(
    client, smtp_settings
):
    smtp_settings.refusing = "451 4.3.0 Try again later"
    response = client.post(
        reverse("account_signup"),
        {
            "email": "milo@uni.example",
            "password1": "a long passphrase 42",
            "password2": "a long passphrase 42",
        },
    )
    assert response.status_code == 302
    waiting = OutboxMessage.objects.get()
    assert waiting.kind == "account/email/email_confirmation_signup"
    assert waiting.state == OutboxState.PENDING and "451" in waiting.last_error
    smtp_settings.refusing = None
    OutboxMessage.objects.update(next_attempt_at=timezone.now())
    assert outbox.send_due() == 1
    message = smtp_settings.wait_for("milo@uni.example", "Please Confirm Your Email Address")
    assert "/accounts/confirm-email/" in smtp_settings.body(message)

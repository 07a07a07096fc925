"""The sign-up, sign-in and two-factor pages as people read them: errors under the
field they are about, required fields marked, the site's own card around them, and
emails that name the portal rather than the host the request came in on."""

from __future__ import annotations

import re

from django.core import mail
from django.urls import reverse

from accounts.models import User


def _field(body: str, name: str) -> str:
    """The HTML of one field's box (``<div class="field …">`` … ``</div>``)."""
    start = body.index(f'name="{name}"')
    opening = body.rindex('<div class="field', 0, start)
    end = body.index('<div class="field', start) if '<div class="field' in body[start:] else -1
    return body[opening:end] if end != -1 else body[opening:]


def test_a_mismatched_password_is_reported_under_the_second_password(client, db):
    response = client.post(
        reverse("account_signup"),
        {
            "email": "milo@uni.example",
            "password1": "a long passphrase 42",
            "password2": "another long one 43",
        },
    )
    assert response.status_code == 200
    assert not User.objects.exists()
    body = response.content.decode()
    second = _field(body, "password2")
    assert "You must type the same password each time." in second
    # Under its input, not above it (where it would read as the first field's).
    assert second.index('name="password2"') < second.index("You must type the same password")
    assert "same password" not in _field(body, "password1")
    assert 'aria-describedby="id_password2_error"' in second


def test_a_weak_password_is_reported_under_the_first_password(client, db):
    response = client.post(
        reverse("account_signup"),
        {"email": "milo@uni.example", "password1": "12345678", "password2": "12345678"},
    )
    body = response.content.decode()
    first = _field(body, "password1")
    after_input = first.split('name="password1"', 1)[1]
    assert 'class="errorlist"' in after_input and "This password is entirely numeric" in after_input
    assert 'class="errorlist"' not in _field(body, "email")


def test_the_sign_up_form_marks_its_required_fields(client, db):
    body = client.get(reverse("account_signup")).content.decode()
    for name in ("email", "password1", "password2"):
        field = _field(body, name)
        assert re.search(r"<label[^>]*>[^<]+ <span class=\"required\">\(required\)</span>", field)
        assert " required" in field


def test_the_account_pages_sit_in_the_sites_card(client, make_user):
    for url in (reverse("account_login"), reverse("account_signup")):
        assert '<section class="card narrow">' in client.get(url).content.decode(), url
    client.force_login(make_user())
    body = client.get(reverse("mfa_index")).content.decode()
    assert '<section class="card narrow">' in body
    # The "Activate" action is one of the site's buttons, not a bare list item.
    assert re.search(r'<a href="/accounts/2fa/totp/activate/?"\s+class="button', body)


def test_allauths_emails_name_the_portal_not_the_host(
    client, db, settings, django_capture_on_commit_callbacks
):
    settings.SITE_URL = "https://tpu.example.org"
    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            reverse("account_signup"),
            {
                "email": "milo@uni.example",
                "password1": "a long passphrase 42",
                "password2": "a long passphrase 42",
            },
        )
    [message] = mail.outbox
    assert message.subject.startswith("[TPU Portal] ")
    assert "Hello from TPU Portal!" in message.body
    assert "Thank you for using TPU Portal!" in message.body
    assert "tpu.example.org" in message.body
    # The test client's host is "testserver": it names nothing but the link.
    assert "from testserver" not in message.body and "on testserver" not in message.body

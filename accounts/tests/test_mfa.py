"""Admins must set up TOTP when the portal requires it; members are not forced."""

from __future__ import annotations

import pytest
from allauth.mfa.models import Authenticator
from allauth.mfa.totp.internal.auth import (
    format_hotp_value,
    hotp_value,
    yield_hotp_counters_from_time,
)
from django.urls import reverse

from tpus.models import AuditEvent


@pytest.fixture
def require_mfa(settings):
    settings.PORTAL_REQUIRE_ADMIN_MFA = True


def _sign_in(client, user):
    """Sign in with the password: right after it, setting up TOTP needs no second one."""
    client.post(
        reverse("account_login"), {"login": user.email, "password": "correct horse battery"}
    )


def test_a_lab_admin_without_totp_is_sent_to_set_it_up_and_then_goes_through(
    client, cast, require_mfa
):
    _sign_in(client, cast.admin)
    response = client.get(reverse("lab_admin", args=[cast.lab.slug]))
    assert response.status_code == 302
    assert response["Location"] == reverse("mfa_activate_totp")
    page = client.get(reverse("mfa_activate_totp"))
    assert page.status_code == 200
    secret = page.context["form"].secret
    code = format_hotp_value(hotp_value(secret, next(yield_hotp_counters_from_time())))
    client.post(reverse("mfa_activate_totp"), {"code": code})
    assert Authenticator.objects.filter(user=cast.admin, type="totp").exists()
    assert client.get(reverse("lab_admin", args=[cast.lab.slug])).status_code == 200


def test_a_site_admin_without_totp_is_sent_to_set_it_up(client, cast, require_mfa):
    client.force_login(cast.site_admin)
    assert client.get(reverse("dashboard"))["Location"] == reverse("mfa_activate_totp")


def test_a_member_is_not_forced(client, cast, require_mfa):
    client.force_login(cast.member)
    assert client.get(reverse("dashboard")).status_code == 200


def test_an_admin_with_totp_goes_through(client, cast, require_mfa):
    Authenticator.objects.create(user=cast.admin, type=Authenticator.Type.TOTP, data={})
    client.force_login(cast.admin)
    assert client.get(reverse("lab_admin", args=[cast.lab.slug])).status_code == 200


def test_totp_can_be_set_up_by_anyone(client, cast):
    _sign_in(client, cast.member)
    assert client.get(reverse("mfa_activate_totp")).status_code == 200


def test_an_admins_sign_in_is_in_the_labs_audit_log(client, cast):
    response = client.post(
        reverse("account_login"),
        {"login": cast.admin.email, "password": "correct horse battery"},
    )
    assert response.status_code == 302
    event = AuditEvent.objects.get(action="admin.login")
    assert (event.actor, event.lab) == (cast.admin, cast.lab)
    assert event.ip_address == "127.0.0.1"


def test_a_members_sign_in_is_not_audited(client, cast):
    client.post(
        reverse("account_login"),
        {"login": cast.member.email, "password": "correct horse battery"},
    )
    assert not AuditEvent.objects.filter(action="admin.login").exists()


def _api_get(client, user, path="/api/v1/me"):
    from accounts.services import create_token

    _token, raw = create_token(user, "cli")
    return client.get(path, HTTP_AUTHORIZATION=f"Bearer {raw}")


@pytest.mark.parametrize("who", ["admin", "site_admin"])
def test_an_admin_without_totp_is_refused_by_the_api_with_a_token(client, cast, require_mfa, who):
    response = _api_get(client, getattr(cast, who))
    assert response.status_code == 403
    detail = response.json()["detail"]
    assert "Two-factor authentication is required" in detail
    assert "http://testserver" + reverse("mfa_activate_totp") in detail


def test_an_admin_without_totp_cannot_change_anything_through_the_api(client, cast, require_mfa):
    from accounts.models import ApiToken
    from accounts.services import create_token

    _token, raw = create_token(cast.admin, "cli")
    response = client.post(
        "/api/v1/tokens",
        {"name": "another"},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw}",
    )
    assert response.status_code == 403
    assert ApiToken.objects.filter(user=cast.admin).count() == 1


def test_a_member_uses_the_api_with_a_token_without_totp(client, cast, require_mfa):
    response = _api_get(client, cast.member)
    assert response.status_code == 200
    assert response.json()["email"] == cast.member.email


def test_an_admin_with_totp_uses_the_api_with_a_token(client, cast, require_mfa):
    Authenticator.objects.create(user=cast.admin, type=Authenticator.Type.TOTP, data={})
    assert _api_get(client, cast.admin).status_code == 200


def test_without_the_requirement_an_admin_uses_the_api_with_a_token(client, cast):
    assert _api_get(client, cast.admin).status_code == 200


def test_setting_up_totp_right_after_signing_in_does_not_ask_for_the_password_again(
    client, cast, require_mfa
):
    _sign_in(client, cast.admin)
    assert client.get(reverse("mfa_activate_totp")).status_code == 200


def test_setting_up_totp_long_after_signing_in_asks_for_the_password(
    client, cast, require_mfa, monkeypatch
):
    import time

    _sign_in(client, cast.admin)
    later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: later)
    response = client.get(reverse("mfa_activate_totp"))
    assert response.status_code == 302 and "reauthenticate" in response["Location"]

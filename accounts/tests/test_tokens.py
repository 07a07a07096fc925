"""Personal access tokens: shown once, stored hashed, revocable; the API accepts them."""

from __future__ import annotations

import pytest
from django.urls import reverse

from accounts.models import ApiToken
from accounts.services import TokenError, create_token, revoke_token


def test_a_token_is_shown_once_and_only_its_hash_is_stored(client, make_user):
    user = make_user()
    client.force_login(user)
    response = client.post(reverse("token_list"), {"name": "laptop cron"})
    raw = response.context["new_token"]
    assert raw.startswith("tpp_") and len(raw) > 40
    token = ApiToken.objects.get(user=user)
    assert raw not in (token.digest, token.hint, token.name)
    assert raw not in client.get(reverse("token_list")).content.decode()


def test_the_api_accepts_a_bearer_token_and_forgets_it_when_revoked(client, make_user):
    user = make_user("milo@uni.example")
    token, raw = create_token(user, "cli")
    response = client.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert response.status_code == 200
    assert response.json()["email"] == "milo@uni.example"
    revoke_token(user, token)
    assert client.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


@pytest.mark.parametrize(
    "header",
    [
        "Bearer tpp_wrong",
        "Bearer ",
        "Token abc",
        "Bearer " + "tpp_" + "a" * 500,
        "Basic Zm9vOmJhcg==",
    ],
)
def test_a_bad_token_is_a_401(client, db, header):
    assert client.get("/api/v1/me", HTTP_AUTHORIZATION=header).status_code == 401


def test_an_inactive_users_token_stops_working(client, make_user):
    user = make_user()
    _, raw = create_token(user, "cli")
    user.is_active = False
    user.save()
    assert client.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


@pytest.mark.parametrize(
    "name, message",
    [("", "Give the token a name"), ("x" * 101, "at most 100"), ("a\nb", "Control characters")],
)
def test_a_bad_token_name_is_refused(make_user, name, message):
    user = make_user()
    with pytest.raises(TokenError, match=message):
        create_token(user, name)
    assert not ApiToken.objects.exists()


def test_tokens_can_be_made_and_revoked_through_the_api(client, make_user):
    user = make_user()
    _, raw = create_token(user, "bootstrap")
    auth = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}
    response = client.post(
        "/api/v1/tokens", {"name": "ci"}, content_type="application/json", **auth
    )
    assert response.status_code == 201
    new = response.json()
    assert new["token"].startswith("tpp_")
    assert client.delete(f"/api/v1/tokens/{new['id']}", **auth).status_code == 204
    assert client.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {new['token']}").status_code == 401


def test_revoking_another_persons_token_through_the_api_is_a_404(client, make_user):
    owner, other = make_user(), make_user()
    token, _ = create_token(owner, "mine")
    _, raw = create_token(other, "theirs")
    response = client.delete(f"/api/v1/tokens/{token.pk}", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert response.status_code == 404
    token.refresh_from_db()
    assert token.revoked_at is None

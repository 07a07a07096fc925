"""API tokens expire: each is made with an end, from the token lifetime of the
person's labs (the shortest when they are in several; the site's when in none), shown
on the tokens page; past it the API answers `token_expired` with the date."""

from __future__ import annotations

import datetime as dt

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiToken
from accounts.services import create_token
from tpus.models import Lab


def lifetime(token: ApiToken) -> dt.timedelta:
    return token.expires_at - token.created_at


def test_someone_in_no_lab_gets_the_sites_lifetime(make_user, settings):
    settings.PORTAL_TOKEN_LIFETIME_DAYS = 45
    token, _ = create_token(make_user(), "laptop")
    assert lifetime(token) == dt.timedelta(days=45)


def test_a_new_lab_starts_with_the_sites_lifetime(make_lab, settings):
    settings.PORTAL_TOKEN_LIFETIME_DAYS = 60
    assert make_lab().token_lifetime_days == 60


def test_someone_in_several_labs_gets_the_shortest_of_theirs(make_user, make_lab, add_member):
    milo = make_user()
    add_member(make_lab(token_lifetime_days=30), milo)
    add_member(make_lab(token_lifetime_days=7), milo)
    # A lab he only asked to join does not count.
    add_member(make_lab(token_lifetime_days=1), milo, state="requested")
    token, _ = create_token(milo, "laptop")
    assert lifetime(token) == dt.timedelta(days=7)


def test_an_expired_token_is_refused_with_a_code_and_its_date(make_user):
    token, raw = create_token(make_user(), "laptop")
    ended = timezone.now() - dt.timedelta(minutes=1)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=ended)
    answer = Client().get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert answer.status_code == 401
    body = answer.json()
    assert body["error"] == "token_expired"
    assert dt.datetime.fromisoformat(body["expired_at"]) == ended
    assert "expired on" in body["detail"] and "tpu login" in body["detail"]
    assert 'error="invalid_token"' in answer["WWW-Authenticate"]
    # An unknown token is still a plain 401, with nothing to tell.
    unknown = Client().get("/api/v1/me", HTTP_AUTHORIZATION="Bearer tpp_nothing")
    assert unknown.status_code == 401 and "error" not in unknown.json()


def test_expired_tokens_do_not_count_against_the_limit(make_user):
    milo = make_user()
    for n in range(20):
        create_token(milo, f"old {n}")
    ApiToken.objects.update(expires_at=timezone.now() - dt.timedelta(days=1))
    create_token(milo, "new laptop")


def test_the_tokens_page_shows_each_end_and_the_lifetime_of_new_ones(
    client, make_user, make_lab, add_member
):
    milo = make_user()
    add_member(make_lab(token_lifetime_days=14), milo)
    live, _ = create_token(milo, "laptop")
    old, _ = create_token(milo, "old box")
    ApiToken.objects.filter(pk=old.pk).update(expires_at=timezone.now() - dt.timedelta(days=1))
    client.force_login(milo)
    page = client.get(reverse("token_list")).content.decode()
    assert "expires after\n    14 days" in page
    assert live.expires_at.strftime("%-d %b %Y") in page
    assert ">expired</span>" in page
    assert page.count(">Revoke</button>") == 1


def test_the_api_lists_each_tokens_end(make_user):
    token, raw = create_token(make_user(), "laptop")
    [row] = Client().get("/api/v1/tokens", HTTP_AUTHORIZATION=f"Bearer {raw}").json()["items"]
    listed = dt.datetime.fromisoformat(row["expires_at"].replace("Z", "+00:00"))
    assert abs(listed - token.expires_at) < dt.timedelta(milliseconds=1)


@pytest.mark.parametrize("days, ok", [(30, True), (0, False), (3651, False)])
def test_a_lab_admin_sets_the_labs_token_lifetime(cast, client, days, ok):
    _, raw = create_token(cast.admin, "admin laptop")
    answer = client.patch(
        "/api/v1/labs/vision/settings",
        {"token_lifetime_days": days},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw}",
    )
    assert (answer.status_code == 200) is ok, answer.json()
    expected = days if ok else Lab._meta.get_field("token_lifetime_days").default()
    assert Lab.objects.get(slug="vision").token_lifetime_days == expected
    if ok:
        assert answer.json()["token_lifetime_days"] == days
        assert lifetime(create_token(cast.member, "laptop")[0]) == dt.timedelta(days=days)


def test_the_lab_settings_page_offers_the_token_lifetime(cast, client):
    client.force_login(cast.admin)
    page = client.get(reverse("lab_settings", args=["vision"])).content.decode()
    assert "API token lifetime (days)" in page
    assert "someone in several labs gets the shortest" in page

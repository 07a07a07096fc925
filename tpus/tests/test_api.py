"""The JSON API: schema and docs, session and token auth, and hostile input."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from accounts.services import create_token
from tpus.models import Membership


@pytest.fixture
def token_for(db):
    def make(user):
        return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}

    return make


def test_the_openapi_schema_lists_the_endpoints(client, db):
    response = client.get("/api/v1/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["info"]["title"] == "TPU Portal API"
    for path in ("/api/v1/me", "/api/v1/labs", "/api/v1/labs/{slug}/join", "/api/v1/tokens"):
        assert path in schema["paths"], path


def test_the_browsable_docs_are_served_without_a_cdn(client, db):
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    body = response.content.decode()
    assert "swagger" in body.lower()
    assert "cdn." not in body


def test_joining_through_the_api(client, cast, token_for):
    cast.lab.discoverable = True
    cast.lab.save()
    newcomer = cast.outsider
    response = client.post(
        f"/api/v1/labs/{cast.lab.slug}/join",
        {"purpose": "Vision transformers.", "accept_policy": True},
        content_type="application/json",
        **token_for(newcomer),
    )
    assert response.status_code == 201, response.content
    assert response.json()["state"] == "requested"


@pytest.mark.parametrize(
    "payload, status, fragment",
    [
        ({"purpose": "x" * 501, "accept_policy": True}, 422, "at most 500"),
        ({"purpose": "a\x00b", "accept_policy": True}, 422, "Control characters"),
        ({"purpose": "ok", "accept_policy": "sure"}, 422, "bool"),
        ({"purpose": ["a"], "accept_policy": True}, 422, "string"),
        ({"purpose": "ok", "accept_policy": False}, 400, "accept the lab"),
        ({"accept_policy": True}, 422, "purpose"),
    ],
)
def test_bad_join_input_gets_a_specific_error_and_changes_nothing(
    client, cast, token_for, payload, status, fragment
):
    cast.lab.discoverable = True
    cast.lab.save()
    response = client.post(
        f"/api/v1/labs/{cast.lab.slug}/join",
        payload,
        content_type="application/json",
        **token_for(cast.outsider),
    )
    assert response.status_code == status
    assert fragment.lower() in response.content.decode().lower()
    assert not Membership.objects.filter(user=cast.outsider, lab=cast.lab).exists()


def test_malformed_json_is_a_400_or_422(client, cast, token_for):
    response = client.post(
        f"/api/v1/labs/{cast.lab.slug}/memberships/{cast.pending_membership.pk}/reject",
        "{not json",
        content_type="application/json",
        **token_for(cast.admin),
    )
    assert response.status_code in {400, 422}
    cast.pending_membership.refresh_from_db()
    assert cast.pending_membership.state == "requested"


def test_session_auth_needs_the_csrf_token_for_changes(cast):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/memberships/{cast.pending_membership.pk}/approve"
    assert browser.get("/api/v1/me").status_code == 200
    assert browser.post(url).status_code in {401, 403}
    cast.pending_membership.refresh_from_db()
    assert cast.pending_membership.state == "requested"


def test_csrf_less_form_posts_are_refused(cast):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(cast.admin)
    from django.urls import reverse

    response = browser.post(
        reverse("membership_approve", args=[cast.lab.slug, cast.pending_membership.pk])
    )
    assert response.status_code == 403
    cast.pending_membership.refresh_from_db()
    assert cast.pending_membership.state == "requested"


def test_a_forged_membership_id_of_another_lab_is_a_404(client, cast, token_for):
    url = f"/api/v1/labs/{cast.lab.slug}/memberships/{cast.other_membership.pk}/approve"
    assert client.post(url, **token_for(cast.admin)).status_code == 404
    cast.other_membership.refresh_from_db()
    assert cast.other_membership.state == "requested"


def test_a_non_numeric_id_is_refused(client, cast, token_for):
    url = f"/api/v1/labs/{cast.lab.slug}/memberships/1%20OR%201=1/approve"
    assert client.post(url, **token_for(cast.admin)).status_code in {404, 422}


def test_an_admin_lists_pending_requests(client, cast, token_for):
    response = client.get(
        f"/api/v1/labs/{cast.lab.slug}/memberships?state=requested", **token_for(cast.admin)
    )
    assert [m["user"] for m in response.json()["items"]] == ["pat@vision.example"]


def test_labs_show_my_own_state(client, cast, token_for):
    response = client.get("/api/v1/labs", **token_for(cast.pending))
    labs = {lab["slug"]: lab for lab in response.json()["items"]}
    assert labs == {"vision": labs["vision"]}
    assert labs["vision"]["my_state"] == "requested"
    assert json.dumps(labs)  # plain JSON all the way down


def test_a_refusal_inside_the_api_is_json_with_its_reason(client, cast, token_for):
    response = client.get(f"/api/v1/labs/{cast.lab.slug}/memberships", **token_for(cast.member))
    assert response.status_code == 403
    assert response["Content-Type"].startswith("application/json")
    assert response.json() == {"detail": "Only the lab's admins can do that."}


def test_an_unknown_lab_in_the_api_is_a_json_404(client, cast, token_for):
    response = client.get("/api/v1/labs/no-such-lab/memberships", **token_for(cast.member))
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")


def test_a_lab_admin_retries_a_failed_grant_through_the_api(
    client, cast, token_for, django_capture_on_commit_callbacks
):
    from tpus.models import Grant, TpuVm

    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="imported")
    grant = Grant.objects.create(user=cast.member, vm=vm, state="failed", error="tpu5-w0: down")
    url = f"/api/v1/labs/{cast.lab.slug}/grants/{grant.pk}/retry"
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post(url, **token_for(cast.admin))
    assert response.status_code == 200
    assert response.json()["state"] == "pending" and response.json()["error"] == ""
    assert len(callbacks) == 1  # the reconcile, after commit
    again = client.post(url, **token_for(cast.admin))
    assert again.status_code == 409 and "only a failed one" in again.json()["detail"]


def test_a_site_admin_creates_a_lab_through_the_api(client, cast, token_for):
    body = {
        "name": "Speech Lab", "slug": "speech", "gcp_project_id": "speech-lab-1",
        "zones": ["europe-west4-a"], "admin_emails": [cast.member.email],
    }  # fmt: skip
    response = client.post(
        "/api/v1/labs", body, content_type="application/json", **token_for(cast.site_admin)
    )
    assert response.status_code == 201, response.content
    assert response.json()["gcp_project_id"] == "speech-lab-1"
    taken = client.post(
        "/api/v1/labs", {**body, "slug": "speech2"}, content_type="application/json",
        **token_for(cast.site_admin),
    )  # fmt: skip
    assert taken.status_code == 400 and "another lab" in taken.json()["detail"]
    refused = client.post(
        "/api/v1/labs", {**body, "slug": "speech3", "gcp_project_id": "speech-lab-3"},
        content_type="application/json", **token_for(cast.admin),
    )  # fmt: skip
    assert refused.status_code == 403
    assert "Only site admins" in refused.json()["detail"]

"""Asking to join a lab, and the admins' decision, through pages, API and services."""

from __future__ import annotations

import pytest
from django.core import mail
from django.urls import reverse

from tpus.models import AuditEvent, Membership
from tpus.services import labs as lab_services


@pytest.fixture
def open_lab(make_lab, make_user, add_member):
    lab = make_lab("Speech Lab", slug="speech", discoverable=True)
    admin = make_user("boss@speech.example")
    add_member(lab, admin, role="admin")
    return lab, admin


def test_a_collaborator_asks_to_join_and_the_admins_are_emailed(
    client, open_lab, make_user, django_capture_on_commit_callbacks
):
    lab, admin = open_lab
    milo = make_user("milo@uni.example")
    client.force_login(milo)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("lab_join", args=[lab.slug]),
            {"purpose": "Pretraining a small speech model.", "accept_policy": "on"},
        )
    assert response.status_code == 302
    membership = Membership.objects.get(user=milo, lab=lab)
    assert membership.state == "requested"
    assert membership.policy_version_accepted == lab.policy_version
    assert [m.to for m in mail.outbox] == [[admin.email]]
    assert "milo@uni.example asks to join Speech Lab" in mail.outbox[0].subject
    assert "Pretraining a small speech model." in mail.outbox[0].body
    assert AuditEvent.objects.filter(lab=lab, action="membership.requested").count() == 1


def test_joining_without_accepting_the_policy_is_refused_and_stores_nothing(
    client, open_lab, make_user
):
    lab, _ = open_lab
    milo = make_user()
    client.force_login(milo)
    response = client.post(reverse("lab_join", args=[lab.slug]), {"purpose": "Research."})
    assert response.status_code == 200
    assert "accept the lab" in response.content.decode()
    assert not Membership.objects.filter(user=milo).exists()
    assert not mail.outbox


@pytest.mark.parametrize(
    "purpose, message",
    [
        ("x" * 501, "at most 500 characters"),
        ("hello\x1b[31m", "Control characters"),
        ("ok\u202eevil", "Control characters"),
        ("", "This field is required"),
    ],
)
def test_a_hostile_purpose_gets_a_specific_error(client, open_lab, make_user, purpose, message):
    lab, _ = open_lab
    user = make_user()
    client.force_login(user)
    response = client.post(
        reverse("lab_join", args=[lab.slug]), {"purpose": purpose, "accept_policy": "on"}
    )
    assert message in response.content.decode()
    assert not Membership.objects.filter(user=user).exists()


def test_asking_twice_keeps_one_request(open_lab, make_user):
    lab, _ = open_lab
    milo = make_user()
    first = lab_services.request_membership(milo, lab, purpose="a", accept_policy=True)
    second = lab_services.request_membership(milo, lab, purpose="b", accept_policy=True)
    assert first.pk == second.pk
    assert Membership.objects.filter(user=milo).count() == 1


def test_approval_emails_the_collaborator_and_is_audited(
    client, open_lab, make_user, django_capture_on_commit_callbacks
):
    lab, admin = open_lab
    milo = make_user("milo@uni.example")
    membership = lab_services.request_membership(milo, lab, purpose="a", accept_policy=True)
    mail.outbox.clear()
    client.force_login(admin)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(reverse("membership_approve", args=[lab.slug, membership.pk]))
    assert response.status_code == 302
    membership.refresh_from_db()
    assert membership.state == "approved"
    assert membership.decided_by == admin
    assert mail.outbox[0].to == ["milo@uni.example"]
    assert "Welcome to Speech Lab" in mail.outbox[0].subject
    event = AuditEvent.objects.get(action="membership.approved")
    assert (event.actor, event.target_user, event.lab) == (admin, milo, lab)


def test_rejection_with_a_note_tells_the_collaborator_why(
    client, open_lab, make_user, django_capture_on_commit_callbacks
):
    lab, admin = open_lab
    milo = make_user("milo@uni.example")
    membership = lab_services.request_membership(milo, lab, purpose="a", accept_policy=True)
    mail.outbox.clear()
    client.force_login(admin)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            reverse("membership_reject", args=[lab.slug, membership.pk]),
            {"note": "Please ask your advisor to email me."},
        )
    membership.refresh_from_db()
    assert membership.state == "rejected"
    assert "Please ask your advisor to email me." in mail.outbox[0].body


def test_htmx_approve_returns_just_the_row(client, open_lab, make_user):
    lab, admin = open_lab
    membership = lab_services.request_membership(make_user(), lab, purpose="a", accept_policy=True)
    client.force_login(admin)
    response = client.post(
        reverse("membership_approve", args=[lab.slug, membership.pk]), HTTP_HX_REQUEST="true"
    )
    body = response.content.decode()
    assert body.lstrip().startswith(f'<tr id="membership-{membership.pk}"')
    assert "Approved" in body


def test_a_decided_request_cannot_be_decided_again(open_lab, make_user):
    lab, admin = open_lab
    membership = lab_services.request_membership(make_user(), lab, purpose="a", accept_policy=True)
    lab_services.reject_membership(admin, membership)
    with pytest.raises(lab_services.LabError, match="Only a pending request"):
        lab_services.approve_membership(admin, membership)
    membership.refresh_from_db()
    assert membership.state == "rejected"


def test_a_rejected_collaborator_may_ask_again(open_lab, make_user):
    lab, admin = open_lab
    milo = make_user()
    membership = lab_services.request_membership(milo, lab, purpose="a", accept_policy=True)
    lab_services.reject_membership(admin, membership)
    again = lab_services.request_membership(milo, lab, purpose="b", accept_policy=True)
    assert again.pk == membership.pk
    assert again.state == "requested"
    assert again.purpose == "b"


def test_the_last_admin_cannot_step_down_or_be_removed(open_lab):
    lab, admin = open_lab
    membership = Membership.objects.get(lab=lab, user=admin)
    with pytest.raises(lab_services.LabError, match="at least one admin"):
        lab_services.set_role(admin, membership, "member")
    with pytest.raises(lab_services.LabError, match="at least one admin"):
        lab_services.remove_member(admin, membership)
    membership.refresh_from_db()
    assert membership.is_admin


def test_a_changed_policy_must_be_accepted_again(client, open_lab, make_user, add_member):
    lab, admin = open_lab
    milo = make_user()
    membership = add_member(lab, milo)
    lab_services.update_lab(admin, lab, {"policy_text": "New rules."})
    lab.refresh_from_db()
    assert lab.policy_version == 2
    client.force_login(milo)
    assert "The lab&#x27;s policy changed" in client.get(
        reverse("lab_detail", args=[lab.slug])
    ).content.decode().replace("'", "&#x27;")
    client.post(reverse("policy_accept", args=[lab.slug]))
    membership.refresh_from_db()
    assert membership.policy_version_accepted == 2


def test_lab_settings_refuse_a_bad_zone_and_keep_the_old_ones(client, open_lab, make_user):
    lab, _ = open_lab
    client.force_login(make_user(is_superuser=True, is_staff=True))
    response = client.post(
        reverse("lab_settings", args=[lab.slug]),
        {
            "name": lab.name,
            "gcp_project_id": lab.gcp_project_id,
            "zones": "us-central1-f, ; rm -rf /",
            "policy_text": lab.policy_text,
        },
    )
    assert response.status_code == 200
    assert "A zone looks like" in response.content.decode()
    lab.refresh_from_db()
    assert lab.zones == ["us-central1-f"]


def test_a_site_admin_opens_a_lab_with_its_first_admin(client, make_user):
    root = make_user(is_superuser=True, is_staff=True)
    boss = make_user("boss@new.example")
    client.force_login(root)
    response = client.post(
        reverse("lab_create"),
        {
            "name": "New Lab",
            "slug": "new-lab",
            "gcp_project_id": "new-lab-123",
            "zones": "us-central1-f europe-west4-a",
            "policy_text": "Research only.",
            "admin_emails": "boss@new.example",
        },
    )
    assert response.status_code == 302
    membership = Membership.objects.get(lab__slug="new-lab")
    assert (membership.user, membership.role, membership.state) == (boss, "admin", "approved")


def test_a_lab_for_an_unknown_admin_is_not_created(client, make_user):
    client.force_login(make_user(is_superuser=True, is_staff=True))
    response = client.post(
        reverse("lab_create"),
        {
            "name": "New Lab",
            "slug": "new-lab",
            "gcp_project_id": "new-lab-123",
            "policy_text": "x",
            "admin_emails": "nobody@nowhere.example",
        },
    )
    assert "need to sign up first" in response.content.decode()
    from tpus.models import Lab

    assert not Lab.objects.filter(slug="new-lab").exists()


def test_approving_in_place_tells_the_member_list_to_reload(client, cast):
    from django.urls import reverse

    client.force_login(cast.admin)
    url = reverse("membership_approve", args=[cast.lab.slug, cast.pending_membership.pk])
    response = client.post(url, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    assert response["HX-Trigger"] == "membersChanged"
    page = client.get(reverse("lab_admin", args=[cast.lab.slug])).content.decode()
    assert "membersChanged from:body" in page

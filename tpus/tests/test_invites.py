"""Invite links: pre-approved membership, once, for the named address only."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from tpus.models import Invite, Membership
from tpus.services import labs as lab_services


@pytest.fixture
def lab_and_admin(make_lab, make_user, add_member):
    lab = make_lab("Robotics", slug="robotics", discoverable=False)
    admin = make_user("boss@robotics.example")
    add_member(lab, admin, role="admin")
    return lab, admin


def test_an_invite_link_joins_the_lab_without_waiting(client, lab_and_admin, make_user):
    lab, admin = lab_and_admin
    client.force_login(admin)
    response = client.post(reverse("invite_create", args=[lab.slug]), {"role": "member"})
    link = response.context["link"]
    milo = make_user()
    client.force_login(milo)
    path = link.removeprefix("http://testserver")
    assert "Join Robotics" in client.get(path).content.decode()
    response = client.post(path, {"accept_policy": "on"})
    assert response.status_code == 302
    membership = Membership.objects.get(user=milo, lab=lab)
    assert (membership.state, membership.role) == ("approved", "member")


def test_an_invite_works_only_once(lab_and_admin, make_user):
    lab, admin = lab_and_admin
    _, raw = lab_services.create_invite(admin, lab)
    lab_services.accept_invite(make_user(), raw, accept_policy=True)
    with pytest.raises(lab_services.LabError, match="used already"):
        lab_services.accept_invite(make_user(), raw, accept_policy=True)


def test_an_invite_for_an_address_refuses_anyone_else(lab_and_admin, make_user):
    lab, admin = lab_and_admin
    _, raw = lab_services.create_invite(admin, lab, email="milo@uni.example")
    eve = make_user("eve@evil.example")
    with pytest.raises(lab_services.LabError, match="milo@uni.example"):
        lab_services.accept_invite(eve, raw, accept_policy=True)
    assert not Membership.objects.filter(user=eve).exists()


def test_an_invite_for_an_address_is_emailed(
    lab_and_admin, make_user, django_capture_on_commit_callbacks
):
    lab, admin = lab_and_admin
    with django_capture_on_commit_callbacks(execute=True):
        _, raw = lab_services.create_invite(admin, lab, email="Milo@Uni.example")
    assert mail.outbox[0].to == ["milo@uni.example"]
    assert f"/invites/{raw}/" in mail.outbox[0].body


def test_an_expired_or_revoked_invite_does_nothing(lab_and_admin, make_user):
    lab, admin = lab_and_admin
    invite, raw = lab_services.create_invite(admin, lab)
    Invite.objects.filter(pk=invite.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    with pytest.raises(lab_services.LabError, match="expired"):
        lab_services.accept_invite(make_user(), raw, accept_policy=True)
    invite2, raw2 = lab_services.create_invite(admin, lab)
    lab_services.revoke_invite(admin, invite2)
    with pytest.raises(lab_services.LabError, match="revoked"):
        lab_services.accept_invite(make_user(), raw2, accept_policy=True)


def test_a_made_up_invite_token_is_a_404(client, make_user):
    client.force_login(make_user())
    assert client.get(reverse("invite", args=["not-a-real-token"])).status_code == 404
    assert (
        client.post(reverse("invite", args=["x" * 500]), {"accept_policy": "on"}).status_code == 404
    )


def test_only_the_hash_of_an_invite_token_is_stored(lab_and_admin):
    lab, admin = lab_and_admin
    invite, raw = lab_services.create_invite(admin, lab)
    assert raw not in {invite.digest, *Invite.objects.values_list("digest", flat=True)}


def test_an_admin_invited_again_stays_admin(lab_and_admin, make_user):
    lab, admin = lab_and_admin
    _, raw = lab_services.create_invite(admin, lab, role="member")
    membership = lab_services.accept_invite(admin, raw, accept_policy=True)
    assert membership.role == "admin"

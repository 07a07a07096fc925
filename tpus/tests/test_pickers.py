"""Choosing a person or a TPU VM by typing: the search endpoints offer a screenful of
the lab's own, and the forms resolve what was typed inside the lab, saying who is
missing and why."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from accounts.models import UnixAccount
from accounts.tests.keydata import ED25519
from tpus.forms.grants import GrantForm, MemberGrantForm
from tpus.models import Grant, Membership, TpuVm, Worker


@pytest.fixture
def scene(cast, make_user):
    UnixAccount.objects.create(user=cast.member, username="milo", uid=30_001)
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10", host_keys=[ED25519])
    outsider_vm = TpuVm.objects.create(
        lab=cast.other_lab, name="tpu9", zone="us-central1-f", source="manual"
    )
    UnixAccount.objects.create(user=cast.outsider, username="eve", uid=30_002)
    return vm, outsider_vm


def _grant_form(cast, user):
    return GrantForm({"user": user, "sudo": "", "expires_on": ""}, lab=cast.lab)


@pytest.mark.parametrize(
    "typed", ["milo", "MILO", " milo ", "milo@vision.example", "Milo@Vision.example"]
)
def test_the_grant_form_finds_a_member_by_username_or_email(cast, scene, typed):
    form = _grant_form(cast, typed)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["user"] == cast.member


def test_the_grant_form_says_when_the_typed_name_matches_no_one_in_the_lab(cast, scene):
    form = _grant_form(cast, "mil")
    assert not form.is_valid()
    assert form.errors["user"] == [
        "No one in Vision Lab has the unix username or email address “mil”."
    ]


@pytest.mark.parametrize("typed", ["eve", "eve@other.example"])
def test_the_grant_form_never_finds_someone_of_another_lab(cast, scene, typed):
    form = _grant_form(cast, typed)
    assert not form.is_valid()
    assert "No one in Vision Lab" in form.errors["user"][0]


def test_the_grant_form_says_a_member_has_no_unix_username_yet(cast, scene, make_user):
    user = make_user("ann@vision.example")
    Membership.objects.create(
        lab=cast.lab, user=user, state="approved", policy_version_accepted=cast.lab.policy_version
    )
    form = _grant_form(cast, "ann@vision.example")
    assert not form.is_valid()
    assert form.errors["user"] == [
        "ann@vision.example has not chosen a unix username yet; they choose one on their "
        "SSH keys page."
    ]


def test_the_grant_form_says_a_request_to_join_is_still_waiting(cast, scene):
    UnixAccount.objects.create(user=cast.pending, username="pat", uid=30_003)
    form = _grant_form(cast, "pat")
    assert not form.is_valid()
    assert form.errors["user"] == [
        "pat@vision.example is not an approved member of Vision Lab: "
        "their request to join is waiting for approval."
    ]


def test_the_grant_form_says_a_member_has_not_accepted_the_current_policy(cast, scene):
    cast.lab.policy_version += 1
    cast.lab.save()
    form = _grant_form(cast, "milo")
    assert not form.is_valid()
    assert form.errors["user"] == [
        "milo@vision.example has not accepted the lab's current policy yet."
    ]


def test_the_grant_form_asks_for_someone_when_nothing_is_typed(cast, scene):
    form = _grant_form(cast, "   ")
    assert not form.is_valid()
    assert form.errors["user"]


def test_giving_access_by_typed_username_creates_the_grant(client, cast, scene):
    vm, _ = scene
    client.force_login(cast.admin)
    response = client.post(reverse("grant_create", args=[cast.lab.slug, vm.pk]), {"user": "milo"})
    assert response.status_code == 302
    assert Grant.objects.get(vm=vm).user == cast.member


def test_a_typed_name_that_matches_no_one_changes_nothing_and_says_why(client, cast, scene):
    vm, _ = scene
    client.force_login(cast.admin)
    response = client.post(reverse("grant_create", args=[cast.lab.slug, vm.pk]), {"user": "eve"})
    assert not Grant.objects.exists()
    [message] = [str(m) for m in get_messages(response.wsgi_request)]
    assert "No one in Vision Lab" in message and "“eve”" in message


def test_the_person_search_offers_the_labs_members_only_and_marks_who_cannot_be_chosen(
    client, cast, scene, make_user
):
    user = make_user("mila@vision.example")
    Membership.objects.create(
        lab=cast.lab, user=user, state="approved", policy_version_accepted=cast.lab.policy_version
    )
    eve_lookalike = make_user("milo@other.example")
    Membership.objects.create(lab=cast.other_lab, user=eve_lookalike, state="approved")
    client.force_login(cast.admin)
    body = client.get(reverse("people_search", args=[cast.lab.slug]), {"user": "mil"})
    body = body.content.decode()
    assert 'data-value="milo"' in body and "milo (milo@vision.example)" in body
    assert 'data-value="mila@vision.example" aria-selected="false" aria-disabled="true"' in body
    assert "has not chosen a unix username yet" in body
    assert "milo@other.example" not in body


def test_the_person_search_offers_at_most_twenty(client, cast, scene, make_user):
    for i in range(30):
        user = make_user(f"student{i}@vision.example")
        Membership.objects.create(lab=cast.lab, user=user, state="approved")
    client.force_login(cast.admin)
    body = client.get(reverse("people_search", args=[cast.lab.slug]), {"user": "student"})
    assert body.content.decode().count('role="option"') == 20


def test_the_person_search_says_when_nothing_matches(client, cast, scene):
    client.force_login(cast.admin)
    body = client.get(reverse("people_search", args=[cast.lab.slug]), {"user": "zz"})
    assert "No match in this lab." in body.content.decode()


def test_the_vm_search_offers_the_labs_vms_only(client, cast, scene):
    client.force_login(cast.admin)
    body = client.get(reverse("vm_search", args=[cast.lab.slug]), {"vm": "tpu"}).content.decode()
    assert 'data-value="tpu5"' in body
    assert "tpu9" not in body


def _member_form(cast, vm):
    return MemberGrantForm({"vm": vm, "sudo": "", "expires_on": ""}, lab=cast.lab)


def test_the_member_grant_form_finds_a_vm_by_name(cast, scene):
    form = _member_form(cast, "TPU5")
    assert form.is_valid(), form.errors
    assert form.cleaned_data["vm"] == scene[0]


@pytest.mark.parametrize("typed", ["tpu9", "tpu"])
def test_the_member_grant_form_refuses_a_vm_the_lab_does_not_have(cast, scene, typed):
    form = _member_form(cast, typed)
    assert not form.is_valid()
    assert form.errors["vm"] == [f"Vision Lab has no TPU VM named “{typed}”."]


def test_the_member_grant_form_refuses_a_vm_gone_from_the_api(cast, scene):
    from django.utils import timezone

    TpuVm.objects.filter(pk=scene[0].pk).update(missing_since=timezone.now())
    form = _member_form(cast, "tpu5")
    assert not form.is_valid()
    assert "gone from the Cloud TPU API" in form.errors["vm"][0]


def test_giving_a_member_a_typed_vm_creates_the_grant(client, cast, scene):
    vm, _ = scene
    client.force_login(cast.admin)
    url = reverse("member_grant", args=[cast.lab.slug, cast.member_membership.pk])
    response = client.post(url, {"vm": "tpu5"})
    assert response.status_code == 302 and response["Location"] == url
    assert Grant.objects.get(user=cast.member).vm == vm


def test_a_member_grant_to_another_labs_vm_changes_nothing(client, cast, scene):
    client.force_login(cast.admin)
    url = reverse("member_grant", args=[cast.lab.slug, cast.member_membership.pk])
    response = client.post(url, {"vm": "tpu9"})
    assert response.status_code == 200
    assert "Vision Lab has no TPU VM named “tpu9”." in response.content.decode()
    assert not Grant.objects.exists()

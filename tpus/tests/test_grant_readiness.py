"""The "Give access" form says who can be given access and why the others cannot yet,
with one query whatever the lab's size."""

from __future__ import annotations

from django.urls import reverse

from accounts.keys import add_key
from accounts.tests.keydata import ED25519
from accounts.unix import choose_username
from tpus.models import Membership
from tpus.services import directory
from tpus.services import labs as lab_services


def _vm(lab, name="tpu5"):
    from tpus.models import TpuVm, Worker

    vm = TpuVm.objects.create(lab=lab, name=name, zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="10.213.0.9", host_keys=["ssh-ed25519 AAAA"])
    return vm


def test_an_empty_lab_says_no_one_can_be_given_access_and_how_to_invite(
    client, make_lab, make_user, add_member
):
    lab = make_lab("Vision", slug="vision")
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    vm = _vm(lab)
    client.force_login(admin)
    body = client.get(reverse("vm_access", args=["vision", vm.pk])).content.decode()
    assert "No member can be given access yet." in body
    # The admin chose no username either: counted, with where to choose one.
    assert "1 member without a unix username" in body and reverse("key_list") in body


def test_each_reason_is_counted_and_linked(client, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision")
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    choose_username(admin, "boss")
    ready = make_user("milo@uni.example")
    add_member(lab, ready)
    choose_username(ready, "milo")
    nameless = make_user("ann@uni.example")
    add_member(lab, nameless)
    asking = make_user("bo@uni.example")
    add_member(lab, asking)
    Membership.objects.filter(user=asking).update(state=Membership.State.REQUESTED)
    stale = make_user("cy@uni.example")
    add_member(lab, stale)
    choose_username(stale, "cy")
    Membership.objects.filter(user=stale).update(policy_version_accepted=None)

    readiness = directory.grant_readiness(lab)
    assert (readiness.ready, readiness.requested, readiness.no_policy, readiness.no_username) == (
        2, 1, 1, 1,
    )  # fmt: skip
    assert readiness.no_key == 2  # boss and milo have no SSH key

    client.force_login(admin)
    body = client.get(reverse("vm_access", args=["vision", _vm(lab).pk])).content.decode()
    assert "2 members can be given access." in body
    assert "1 request to join waiting for your approval" in body
    assert reverse("lab_admin", args=["vision"]) + "#requests" in body
    assert "1 member who must accept the lab's current policy" in body
    assert "1 member without a unix username" in body
    assert "2 of those who can be given access have no SSH key yet" in body


def test_the_count_is_one_query_at_any_size(
    make_lab, make_user, add_member, django_assert_num_queries
):
    lab = make_lab("Vision", slug="vision")
    for i in range(30):
        add_member(lab, make_user(f"p{i}@uni.example"))
    with django_assert_num_queries(1):
        directory.count_readiness(lab)


def test_the_counts_are_cached_and_every_change_they_depend_on_is_seen_at_once(
    make_lab, make_user, add_member, django_assert_num_queries, django_capture_on_commit_callbacks
):
    lab = make_lab("Vision", slug="vision")
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    ann = make_user("ann@uni.example")
    add_member(lab, ann, state="requested")
    assert directory.grant_readiness(lab).no_username == 2
    with django_assert_num_queries(1):  # only the memberships' stamp
        assert directory.grant_readiness(lab).no_username == 2

    with django_capture_on_commit_callbacks(execute=True):
        choose_username(milo, "milo")
    readiness = directory.grant_readiness(lab)
    assert (readiness.ready, readiness.no_username, readiness.no_key) == (1, 1, 1)
    with django_capture_on_commit_callbacks(execute=True):
        add_key(milo, ED25519)
    assert directory.grant_readiness(lab).no_key == 0
    lab_services.approve_membership(admin, Membership.objects.get(user=ann))
    assert directory.grant_readiness(lab).requested == 0
    lab.policy_version += 1
    lab.save()
    assert directory.grant_readiness(lab).no_policy == 3


def test_a_member_who_has_access_already_is_not_counted_as_one_who_can_be_given_it(
    client, make_lab, make_user, add_member
):
    from tpus.models import Grant

    lab = make_lab("Vision", slug="vision")
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    choose_username(admin, "boss")
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    vm, other = _vm(lab), _vm(lab, "tpu6")
    Grant.objects.create(user=milo, vm=vm, state="active")
    client.force_login(admin)

    body = client.get(reverse("vm_access", args=["vision", vm.pk])).content.decode()

    assert "1 more member can be given access." in body  # boss, not milo
    assert "1 already has access to tpu5." in body
    assert "1 of those who can be given access has no SSH key yet" in body
    # On another VM, milo can be given access.
    body = client.get(reverse("vm_access", args=["vision", other.pk])).content.decode()
    assert "2 members can be given access." in body and "already ha" not in body

    Grant.objects.create(user=admin, vm=vm, state="pending")  # on its way: has it too
    body = client.get(reverse("vm_access", args=["vision", vm.pk])).content.decode()
    assert "No other member can be given access yet." in body
    assert "2 already have access to tpu5." in body
    assert "no SSH key yet" not in body
    # A revoked grant is no access: milo can be given it again.
    Grant.objects.filter(user=milo, vm=vm).update(state="revoked")
    body = client.get(reverse("vm_access", args=["vision", vm.pk])).content.decode()
    assert "1 more member can be given access." in body and "1 already has access" in body

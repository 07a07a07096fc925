"""Grants on a kind of TPU VM: "milo may use any v4-8 of the lab", now and later."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from accounts.unix import choose_username
from tpus.models import AuditEvent, Grant, KindGrant, LabAllowance, TpuVm, Worker
from tpus.services import grants as grant_services
from tpus.services import inventory, kind_grants, labs
from tpus.services.grants import GrantError, grant_access
from tpus.services.kind_grants import grant_kind, revoke_kind_grant

PIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
ZONE = "us-central1-f"


def make_vm(lab, name, kind="v4-8", *, pinned=True, address=None):
    vm = TpuVm.objects.create(lab=lab, name=name, zone=ZONE, source="manual", accelerator_type=kind)
    Worker.objects.create(
        vm=vm,
        index=0,
        external_ip=address or f"192.0.2.{TpuVm.objects.count() + 10}",
        host_keys=[PIN] if pinned else [],
    )
    return vm


@pytest.fixture
def scene(make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", gcp_project_id="vision-lab-1", zones=[ZONE])
    # v4 VMs may come later: the lab's allowance has room for them.
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="on-demand", chips=16)
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    return lab, admin, type(milo).objects.get(pk=milo.pk)


def wanted(user):
    return sorted(
        Grant.objects.filter(user=user, state__in=("pending", "active", "failed")).values_list(
            "vm__name", flat=True
        )
    )


def test_granting_a_kind_grants_every_vm_of_that_type_and_no_other(scene):
    lab, admin, milo = scene
    a, b = make_vm(lab, "pool-a"), make_vm(lab, "pool-b")
    make_vm(lab, "big", "v4-32")
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=True)
    assert wanted(milo) == ["pool-a", "pool-b"]
    assert set(Grant.objects.values_list("from_kind", "sudo")) == {(kind.pk, True)}
    for vm in (a, b):  # each VM is reconciled once, as a grant by hand does it
        vm.refresh_from_db()
        assert vm.desired_version == 1
    assert AuditEvent.objects.filter(action="kind_grant.created", target_user=milo).count() == 1
    assert AuditEvent.objects.filter(action="grant.created", target_user=milo).count() == 2


def test_granting_a_kind_twice_changes_nothing_the_second_time(scene):
    lab, admin, milo = scene
    vm = make_vm(lab, "pool-a")
    first = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    second = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    assert first.pk == second.pk
    vm.refresh_from_db()
    assert vm.desired_version == 1
    assert Grant.objects.count() == 1


def test_a_vm_of_the_kind_imported_later_gets_the_grant(scene, tpu_emulator):
    lab, admin, milo = scene
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False, expires_on=None)
    assert not Grant.objects.exists()
    tpu_emulator.controls.add_node(
        "vision-lab-1", ZONE, "late", accelerator_type="v4-8", external_ips=["34.0.0.9"]
    )
    tpu_emulator.controls.add_node(
        "vision-lab-1", ZONE, "other", accelerator_type="v5litepod-8", external_ips=["34.0.0.8"]
    )
    inventory.import_vms(admin, lab, [f"{ZONE}/late", f"{ZONE}/other"])
    [grant] = Grant.objects.all()
    assert (grant.vm.name, grant.from_kind_id, grant.state) == ("late", kind.pk, "pending")
    assert grant.created_by is None  # the portal gave it, by the kind grant's rule


def test_a_vm_registered_by_hand_gets_the_grant_once_its_host_keys_are_pinned(scene, make_user):
    lab, admin, milo = scene
    site_admin = make_user("root@portal.example", is_superuser=True, is_staff=True)
    grant_kind(admin, lab, milo, "v4-8", sudo=False)
    vm = inventory.register_manual_vm(
        site_admin,
        lab,
        name="byhand",
        zone=ZONE,
        accelerator_type="v4-8",
        workers=[inventory.ManualWorker(None, "192.0.2.77")],
    )
    assert not Grant.objects.exists()  # not before an admin confirmed its host keys
    inventory.pin_host_keys(admin, vm.workers.get(), [PIN])
    assert wanted(milo) == ["byhand"]


def test_revoking_the_kind_grant_revokes_only_the_grants_it_made(scene):
    lab, admin, milo = scene
    by_hand, from_kind = make_vm(lab, "pool-a"), make_vm(lab, "pool-b")
    grant_access(admin, lab, milo, [by_hand], sudo=False)
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=True)
    # The hand grant stays as the admin gave it (no sudo), and is not the kind's.
    hand = Grant.objects.get(vm=by_hand)
    assert (hand.from_kind_id, hand.sudo) == (None, False)
    revoke_kind_grant(admin, kind)
    assert wanted(milo) == ["pool-a"]
    assert Grant.objects.get(vm=from_kind).state == "revoking"
    kind.refresh_from_db()
    assert kind.state == "revoked"
    assert revoke_kind_grant(admin, kind).state == "revoked"  # twice is fine


def test_granting_by_hand_a_vm_the_kind_covers_makes_it_a_hand_grant(scene):
    lab, admin, milo = scene
    vm = make_vm(lab, "pool-a")
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    assert grant.from_kind_id is None
    vm.refresh_from_db()
    assert vm.desired_version == 1  # the hosts need nothing new
    revoke_kind_grant(admin, kind)
    assert wanted(milo) == ["pool-a"]


def test_a_kind_granted_again_after_a_revoke_reuses_the_rows(scene):
    lab, admin, milo = scene
    make_vm(lab, "pool-a")
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    revoke_kind_grant(admin, kind)
    again = grant_kind(admin, lab, milo, "v4-8", sudo=True)
    assert again.pk == kind.pk and again.state == "active"
    [grant] = Grant.objects.all()
    assert (grant.state, grant.sudo, grant.from_kind_id) == ("pending", True, kind.pk)


def test_a_vm_grant_revoked_by_hand_is_not_given_back_when_its_vm_is_imported_again(scene):
    lab, admin, milo = scene
    vm = make_vm(lab, "pool-a")
    grant_kind(admin, lab, milo, "v4-8", sudo=False)
    grant_services.revoke_access(admin, Grant.objects.get())
    assert kind_grants.apply_kind_grants(vm) == []
    assert wanted(milo) == []


def test_an_expired_kind_grant_ends_with_its_vm_grants(scene):
    lab, admin, milo = scene
    make_vm(lab, "pool-a")
    ends = timezone.localdate() + dt.timedelta(days=3)
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False, expires_on=ends)
    assert Grant.objects.get().expires_on == ends
    assert grant_services.expire_grants(ends + dt.timedelta(days=1)) == 1
    kind.refresh_from_db()
    assert kind.state == "revoked"
    assert wanted(milo) == []
    # A VM of the kind that joins afterwards gets nothing.
    assert kind_grants.apply_kind_grants(make_vm(lab, "pool-b")) == []


def test_the_end_of_the_labs_tpu_grant_ends_kind_grants(scene):
    lab, admin, milo = scene
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    grant_services.expire_grants()
    kind.refresh_from_db()
    assert kind.state == "revoked"


def test_leaving_the_lab_revokes_kind_grants_too(scene):
    lab, admin, milo = scene
    make_vm(lab, "pool-a")
    kind = grant_kind(admin, lab, milo, "v4-8", sudo=False)
    labs.remove_member(admin, milo.memberships.get(lab=lab))
    kind.refresh_from_db()
    assert kind.state == "revoked"
    assert wanted(milo) == []
    assert kind_grants.apply_kind_grants(make_vm(lab, "pool-b")) == []


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown kind", "has no v9-8 and no allowance for v9 chips"),
        ("not a kind", "is not an accelerator type"),
        ("past date", "must be in the future"),
        ("not a member", "not a member of Vision"),
        ("another lab's person", "not a member of Vision"),
        ("policy", "current policy"),
    ],
)
def test_a_kind_grant_that_cannot_be_given_says_why_and_stores_nothing(
    scene, make_lab, make_user, add_member, case, message
):
    lab, admin, milo = scene
    vm = make_vm(lab, "pool-a")
    person, kind, expires_on = milo, "v4-8", None
    if case == "unknown kind":
        kind = "v9-8"
    elif case == "not a kind":
        kind = "v4-8; rm -rf /"
    elif case == "past date":
        expires_on = timezone.localdate()
    elif case == "not a member":
        person = make_user("stranger@example.org")
    elif case == "another lab's person":
        person = make_user("ana@other.example")
        add_member(make_lab("Other"), person)
    elif case == "policy":
        lab.policy_version += 1
        lab.save()
    with pytest.raises(GrantError, match=message):
        grant_kind(admin, lab, person, kind, sudo=False, expires_on=expires_on)
    assert not KindGrant.objects.exists()
    assert not Grant.objects.exists()
    vm.refresh_from_db()
    assert vm.desired_version == 0


def test_a_kind_the_lab_has_no_vm_of_but_an_allowance_for_can_be_granted(scene):
    lab, admin, milo = scene
    LabAllowance.objects.create(lab=lab, generation="v5litepod", provisioning="spot", chips=8)
    kind = grant_kind(admin, lab, milo, "v5litepod-8", sudo=False)
    assert kind.state == "active" and not Grant.objects.exists()


def test_a_vm_joining_gives_everyone_its_kind_grants_with_one_reconcile(
    scene, make_user, add_member, queued_tasks, django_capture_on_commit_callbacks
):
    lab, admin, milo = scene
    ann = make_user("ann@uni.example")
    add_member(lab, ann)
    choose_username(ann, "ann")
    for person in (milo, type(ann).objects.get(pk=ann.pk)):
        grant_kind(admin, lab, person, "v4-8", sudo=False)
    vm = make_vm(lab, "pool-a", pinned=False)
    queued_tasks.take("tpus.tasks.reconcile_vm")
    with django_capture_on_commit_callbacks(execute=True):
        inventory.pin_host_keys(admin, vm.workers.get(), [PIN])
    assert Grant.objects.filter(vm=vm, from_kind__isnull=False).count() == 2
    assert queued_tasks.take("tpus.tasks.reconcile_vm") == [((vm.pk,), None)]

"""Grant expiry, the lab's end date, and the warning a week before."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import mail
from django.utils import timezone

from accounts.unix import choose_username
from tpus.models import Grant, TpuVm, Worker
from tpus.services import grants as grant_services
from tpus.services.grants import GrantError, grant_access
from tpus.tasks import expire_grants

PIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


@pytest.fixture
def scene(make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision")
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    vm = TpuVm.objects.create(lab=lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.5", host_keys=[PIN])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    return lab, admin, vm, type(milo).objects.get(pk=milo.pk)


def test_an_expired_grant_is_revoked(scene):
    lab, admin, vm, milo = scene
    Grant.objects.create(user=milo, vm=vm, state="active", expires_on=timezone.localdate())
    today = timezone.localdate() + dt.timedelta(days=1)
    assert grant_services.expire_grants(today) == 1
    assert Grant.objects.get().state == "revoking"
    assert grant_services.expire_grants(today) == 0


def test_the_labs_end_date_revokes_every_grant(scene):
    lab, admin, vm, milo = scene
    Grant.objects.create(user=milo, vm=vm, state="active")
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    assert grant_services.expire_grants() == 1
    assert Grant.objects.get().state == "revoking"


def test_a_week_before_the_end_the_holder_is_warned_once(scene, django_capture_on_commit_callbacks):
    lab, admin, vm, milo = scene
    ends = timezone.localdate() + dt.timedelta(days=6)
    Grant.objects.create(user=milo, vm=vm, state="active", expires_on=ends)
    with django_capture_on_commit_callbacks(execute=True):
        expire_grants.run()
        expire_grants.run()
    warnings = [m for m in mail.outbox if "ends soon" in m.subject]
    assert len(warnings) == 1
    assert warnings[0].to == ["milo@uni.example"]
    assert ends.strftime("%-d %B %Y") in warnings[0].body


@pytest.mark.parametrize(
    "change, message",
    [
        ({"expires_on": "past"}, "must be in the future"),
        ({"lab_end": "past"}, "grant ended"),
        ({"expires_on": "after_lab_end"}, "cannot outlast"),
        ({"no_account": True}, "unix username"),
        ({"unpinned": True}, "without pinned host keys"),
        ({"policy": True}, "current policy"),
    ],
)
def test_a_grant_that_cannot_be_given_says_why_and_changes_nothing(scene, change, message):
    lab, admin, vm, milo = scene
    today = timezone.localdate()
    expires_on = None
    if change.get("expires_on") == "past":
        expires_on = today - dt.timedelta(days=1)
    if change.get("lab_end") == "past":
        lab.grant_end_date = today
        lab.save()
    if change.get("expires_on") == "after_lab_end":
        lab.grant_end_date = today + dt.timedelta(days=10)
        lab.save()
        expires_on = today + dt.timedelta(days=20)
    if change.get("no_account"):
        milo.unix_account.delete()
        milo = type(milo).objects.get(pk=milo.pk)
    if change.get("unpinned"):
        Worker.objects.filter(vm=vm).update(host_keys=[])
    if change.get("policy"):
        lab.policy_version += 1
        lab.save()
    with pytest.raises(GrantError, match=message):
        grant_access(admin, lab, milo, [vm], sudo=False, expires_on=expires_on)
    assert not Grant.objects.exists()
    vm.refresh_from_db()
    assert vm.desired_version == 0


def test_a_state_hosts_must_never_see_fails_the_grant_without_contacting_anyone(
    scene, settings, monkeypatch
):
    from tpus.remote import ssh
    from tpus.services.reconcile import reconcile_vm

    lab, admin, vm, milo = scene
    [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    settings.PORTAL_UID_MAX = settings.PORTAL_UID_MIN  # milo's UID is now outside it
    milo.unix_account.uid = settings.PORTAL_UID_MIN + 5
    milo.unix_account.save()
    monkeypatch.setattr(ssh, "execute", lambda *a, **k: pytest.fail("contacted a worker"))
    reconcile_vm(vm.pk)
    grant.refresh_from_db()
    assert grant.state == "failed"
    assert "outside" in grant.error

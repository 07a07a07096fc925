"""A grant a worker refused because a local account holds the person's UID or name
heals soon after the admin removes that account, with the portal's defaults, while a
VM with refused grants is tried at most once per back-off."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from portal.settings import base
from tpus.models import Grant, TpuVm
from tpus.services import maintenance, reconcile


def test_with_the_defaults_a_refused_grant_is_tried_again_within_a_minute_however_often(
    settings,
):
    settings.PORTAL_GRANT_RETRY_SECONDS = base.PORTAL_GRANT_RETRY_SECONDS
    settings.PORTAL_GRANT_RETRY_MAX_SECONDS = base.PORTAL_GRANT_RETRY_MAX_SECONDS
    delays = [reconcile.retry_delay(n).total_seconds() for n in range(1, 200)]
    # The next try is due after the back-off and found by the next frequent check.
    assert max(delays) + base.PORTAL_STALLED_CHECK_SECONDS <= 60
    # Bounded: never more often than the first back-off, and backing off at first.
    assert delays[0] == base.PORTAL_GRANT_RETRY_SECONDS >= 10
    assert delays == sorted(delays)


@pytest.fixture
def vm(make_lab):
    return TpuVm.objects.create(lab=make_lab(), name="tpu5", zone="us-central1-f", source="manual")


def _failed(vm, make_user, retry_in: float) -> Grant:
    return Grant.objects.create(
        user=make_user(),
        vm=vm,
        state="failed",
        failures=3,
        retry_at=timezone.now() + dt.timedelta(seconds=retry_in),
    )


def test_the_frequent_check_queues_a_vm_whose_refused_grant_is_due(vm, make_user, monkeypatch):
    queued = []
    monkeypatch.setattr(maintenance.queue, "reconcile_vm", queued.append)
    _failed(vm, make_user, retry_in=-1)
    _failed(vm, make_user, retry_in=-5)  # two grants, one run

    maintenance.rerun_stalled_claims()

    assert queued == [vm.pk]


def test_a_refused_grant_not_yet_due_leaves_the_hosts_alone(vm, make_user, monkeypatch):
    queued = []
    monkeypatch.setattr(maintenance.queue, "reconcile_vm", queued.append)
    _failed(vm, make_user, retry_in=30)

    maintenance.rerun_stalled_claims()

    assert queued == []


def test_out_of_retries_a_grant_on_a_vm_still_taking_the_lab_key_is_not_failed(vm, make_user):
    from tpus.models import VmConnection, Worker, WorkerSync

    worker = Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10")
    WorkerSync.objects.create(
        worker=worker, last_error="the VM is still taking the lab's key", last_error_retryable=True
    )
    grant = Grant.objects.create(user=make_user(), vm=vm, state="pending", version=1)
    connection = VmConnection.objects.create(vm=vm, state="connecting")

    reconcile.give_up(vm.pk)  # the connection check reconciles once the key is taken
    grant.refresh_from_db()
    assert grant.state == "pending"

    VmConnection.objects.filter(pk=connection.pk).update(state="failed")
    reconcile.give_up(vm.pk)  # the key never came: now the grant fails with the reason
    grant.refresh_from_db()
    assert grant.state == "failed"


def test_a_vm_still_taking_the_lab_key_is_tried_again_soon_then_less_often():
    from tpus.tasks.hosts import RECONCILE_RETRIES

    waiting = reconcile.ReconcileReport(vm_id=1, waiting_for_key=True)
    unreachable = reconcile.ReconcileReport(vm_id=1, retryable={0: "timed out"})
    soon = [reconcile.next_try_in(waiting, n) for n in range(RECONCILE_RETRIES)]
    # A new VM's key is often there a tenth of a second after the refusal: the first
    # retry comes then, not a second later; the pause doubles, so the retries still
    # cover the seconds a guest agent may take (then the connection check goes on).
    assert soon[0] == 0.1
    assert soon == sorted(soon) and soon[-1] == 0.1 * 2 ** (RECONCILE_RETRIES - 1)
    assert sum(soon) >= 6
    # Workers that could not be reached back off from seconds, as before.
    assert reconcile.next_try_in(unreachable, 0) >= 1

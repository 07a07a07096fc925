"""One reconcile per VM at a time, held by a short lease that the running reconcile
renews: a run that fails or dies never holds a VM for long (a revoke included)."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.db import DatabaseError
from django.utils import timezone

from tpus.models import TpuVm
from tpus.services import reconcile


@pytest.fixture
def vm(make_lab):
    return TpuVm.objects.create(lab=make_lab(), name="tpu5", zone="us-central1-f", source="manual")


def test_a_lapsed_claim_is_released_so_the_vm_runs_again(vm):
    TpuVm.objects.filter(pk=vm.pk).update(
        reconcile_claimed_until=timezone.now() - dt.timedelta(seconds=1)
    )
    assert reconcile.release_stalled_claims() == [vm.pk]
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until is None


def test_a_live_claim_is_left_to_its_holder(vm):
    until = timezone.now() + dt.timedelta(seconds=20)
    TpuVm.objects.filter(pk=vm.pk).update(reconcile_claimed_until=until)
    assert reconcile.release_stalled_claims() == []
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until == until


def test_a_reconcile_that_fails_gives_its_claim_back(vm, monkeypatch):
    def broken(vm_id, report, token):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(reconcile, "_run_once", broken)
    with pytest.raises(DatabaseError):
        reconcile.reconcile_vm(vm.pk)
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until is None
    # ... so the next one is not turned away as busy.
    monkeypatch.setattr(reconcile, "_run_once", lambda vm_id, report, token: None)
    assert not reconcile.reconcile_vm(vm.pk).busy


@pytest.mark.django_db(transaction=True)
def test_a_long_run_renews_its_lease_and_a_second_run_stays_out(make_lab, settings, monkeypatch):
    settings.PORTAL_RECONCILE_CLAIM_SECONDS = 1
    vm = TpuVm.objects.create(lab=make_lab(), name="tpu6", zone="us-central1-f", source="manual")
    seen = {}

    def slow(vm_id, report, token):
        seen["first"] = TpuVm.objects.get(pk=vm_id).reconcile_claimed_until
        time.sleep(2.5)  # longer than two leases
        seen["later"] = TpuVm.objects.get(pk=vm_id).reconcile_claimed_until
        seen["other_run_busy"] = reconcile.reconcile_vm(vm_id).busy
        seen["stalled"] = reconcile.release_stalled_claims()

    monkeypatch.setattr(reconcile, "_run_once", slow)
    reconcile.reconcile_vm(vm.pk)
    assert seen["later"] > seen["first"] + dt.timedelta(seconds=1)
    assert seen["later"] > timezone.now() - dt.timedelta(seconds=1)
    assert seen["other_run_busy"] is True
    assert seen["stalled"] == []
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until is None


# --- claim tokens and revokes that take a VM over ------------------------------------


def _held(vm, *, version: int, token: str = "a" * 32, seconds: int = 30) -> None:
    """Another run holds the VM: a live lease, its token, the version it applies."""
    TpuVm.objects.filter(pk=vm.pk).update(
        reconcile_claimed_until=timezone.now() + dt.timedelta(seconds=seconds),
        reconcile_claim=token,
        reconcile_claim_version=version,
    )


def _grant(vm, make_user, *, state: str, version: int):
    from tpus.models import Grant

    return Grant.objects.create(user=make_user(), vm=vm, state=state, version=version)


def test_a_revoke_the_holder_does_not_carry_takes_the_vm_over(vm, make_user, monkeypatch):
    _held(vm, version=3)
    _grant(vm, make_user, state="revoking", version=4)
    ran = []
    monkeypatch.setattr(reconcile, "_run_once", lambda vm_id, report, token: ran.append(token))

    report = reconcile.reconcile_vm(vm.pk)

    assert not report.busy and len(ran) == 1 and ran[0] != "a" * 32
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until is None and vm.reconcile_claim == ""


def test_a_holder_applying_the_revoke_already_is_left_to_finish(vm, make_user, monkeypatch):
    _held(vm, version=4)
    _grant(vm, make_user, state="revoking", version=4)
    monkeypatch.setattr(reconcile, "_run_once", lambda *a: pytest.fail("ran beside the holder"))

    assert reconcile.reconcile_vm(vm.pk).busy
    vm.refresh_from_db()
    assert vm.reconcile_claim == "a" * 32


def test_without_a_waiting_revoke_a_claimed_vm_is_left_to_its_holder(vm, make_user, monkeypatch):
    _held(vm, version=3)
    _grant(vm, make_user, state="pending", version=4)  # the holder runs again for it
    monkeypatch.setattr(reconcile, "_run_once", lambda *a: pytest.fail("ran beside the holder"))

    assert reconcile.reconcile_vm(vm.pk).busy


def test_a_run_releases_and_renews_only_its_own_claim(vm, monkeypatch):
    def taken_over_midway(vm_id, report, token):
        # A revoke takes the VM over while this run is still going.
        TpuVm.objects.filter(pk=vm_id).update(reconcile_claim="b" * 32)

    monkeypatch.setattr(reconcile, "_run_once", taken_over_midway)
    reconcile.reconcile_vm(vm.pk)

    vm.refresh_from_db()
    assert vm.reconcile_claim == "b" * 32
    assert vm.reconcile_claimed_until is not None  # the other run's claim is left alone


def test_a_run_whose_claim_was_taken_stops_before_contacting_any_worker(vm, monkeypatch):
    _held(vm, version=0, token="b" * 32)
    monkeypatch.setattr(reconcile, "run_on_workers", lambda *a: pytest.fail("contacted"))
    report = reconcile.ReconcileReport(vm.pk)

    reconcile._run_once(vm.pk, report, "a" * 32)

    assert report.busy
    vm.refresh_from_db()
    assert (vm.reconcile_claim, vm.reconcile_claim_version) == ("b" * 32, 0)


def test_the_desired_state_carries_the_vms_series_and_version(vm):
    TpuVm.objects.filter(pk=vm.pk).update(desired_version=7)
    vm.refresh_from_db()
    state = reconcile.desired_state(vm)
    assert state.version == 7
    assert state.series == f"vm{vm.pk}-{int(vm.created_at.timestamp() * 1_000_000)}"


def test_a_retry_finds_the_workers_reached_meanwhile_and_runs_no_more(make_lab):
    """A new VM's first reconcile met workers that had not taken the lab's key yet and
    asked to try again; the connection check's reconcile reached them meanwhile. The
    retry has nothing to apply and contacts no worker; once the VM must change again,
    a retry runs."""
    from tpus.models import AuditEvent, WorkerSync
    from tpus.tasks.hosts import reconcile_vm
    from tpus.tests.jobs_support import make_vm

    vm = make_vm(make_lab())
    TpuVm.objects.filter(pk=vm.pk).update(desired_version=3)
    (worker,) = vm.workers.all()
    WorkerSync.objects.create(worker=worker, applied_version=3)
    reconcile_vm.apply(args=(vm.pk,), retries=1)
    assert not AuditEvent.objects.filter(action="vm.reconciled").exists()
    assert WorkerSync.objects.get(worker=worker).last_attempt_at is None
    TpuVm.objects.filter(pk=vm.pk).update(desired_version=4)
    reconcile_vm.apply(args=(vm.pk,), retries=1)
    assert AuditEvent.objects.filter(action="vm.reconciled", data__vm=vm.pk).exists()

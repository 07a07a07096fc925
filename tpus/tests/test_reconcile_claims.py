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
    def broken(vm_id, report):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(reconcile, "_run_once", broken)
    with pytest.raises(DatabaseError):
        reconcile.reconcile_vm(vm.pk)
    vm.refresh_from_db()
    assert vm.reconcile_claimed_until is None
    # ... so the next one is not turned away as busy.
    monkeypatch.setattr(reconcile, "_run_once", lambda vm_id, report: None)
    assert not reconcile.reconcile_vm(vm.pk).busy


@pytest.mark.django_db(transaction=True)
def test_a_long_run_renews_its_lease_and_a_second_run_stays_out(make_lab, settings, monkeypatch):
    settings.PORTAL_RECONCILE_CLAIM_SECONDS = 1
    vm = TpuVm.objects.create(lab=make_lab(), name="tpu6", zone="us-central1-f", source="manual")
    seen = {}

    def slow(vm_id, report):
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

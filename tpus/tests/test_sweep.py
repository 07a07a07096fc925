"""The periodic sweep picks up exactly the VMs that need another reconcile."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from tpus.models import DataDisk, DiskAttachment, Grant, TpuVm, Worker, WorkerSync
from tpus.services.maintenance import vms_to_reconcile


def _vm(lab, name, *, desired=1, applied=1, success_ago=60, grant_state="active", user=None):
    vm = TpuVm.objects.create(
        lab=lab, name=name, zone="us-central1-f", source="imported", desired_version=desired
    )
    worker = Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.1")
    WorkerSync.objects.create(
        worker=worker,
        applied_version=applied,
        last_success_at=timezone.now() - dt.timedelta(seconds=success_ago),
    )
    Grant.objects.create(user=user, vm=vm, state=grant_state)
    return vm


def test_the_sweep_finds_stuck_behind_and_stale_vms_only(cast):
    quiet = _vm(cast.lab, "quiet", user=cast.member)
    pending = _vm(cast.lab, "pending", grant_state="pending", user=cast.member)
    behind = _vm(cast.lab, "behind", desired=3, applied=2, user=cast.member)
    stale = _vm(cast.lab, "stale", success_ago=7200, user=cast.member)
    gone = _vm(cast.lab, "gone", desired=3, applied=1, user=cast.member)
    TpuVm.objects.filter(pk=gone.pk).update(missing_since=timezone.now())
    found = set(vms_to_reconcile())
    assert found == {pending.pk, behind.pk, stale.pk}
    assert quiet.pk not in found


def test_a_disk_change_on_a_vm_nobody_has_access_to_is_swept_up_too(cast):
    def bare(name, *, desired, applied):
        vm = TpuVm.objects.create(
            lab=cast.lab,
            name=name,
            zone="us-central1-f",
            source="imported",
            desired_version=desired,
        )
        worker = Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.1")
        if applied is not None:
            WorkerSync.objects.create(worker=worker, applied_version=applied)
        return vm

    with_disk = bare("with-disk", desired=2, applied=1)
    disk = DataDisk.objects.create(lab=cast.lab, name="scratch", zone="us-central1-f")
    DiskAttachment.objects.create(disk=disk, vm=with_disk)
    last_grant_gone = bare("last-grant-gone", desired=4, applied=3)  # unmount or revoke owed
    never_used = bare("never-used", desired=0, applied=None)  # nothing to keep right
    found = set(vms_to_reconcile())
    assert {with_disk.pk, last_grant_gone.pk} <= found
    assert never_used.pk not in found

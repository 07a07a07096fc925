"""What beat runs: the heartbeat, the inventory sync, the sweeps and grant expiry."""

from __future__ import annotations

from django.conf import settings

from portal import heartbeat
from portal.celery import every
from tpus.models import Lab
from tpus.services import allowances, disk_mounts, grants, maintenance, snapshots, sync
from tpus.tasks.naming import task


@every(settings.PORTAL_HEARTBEAT_SECONDS, name="heartbeat")
@task(ignore_result=True)
def record_heartbeat() -> None:
    """Proves beat and a worker are both running (shown to site admins)."""
    heartbeat.beat()


@every(settings.PORTAL_SYNC_SECONDS, name="sync-inventory")
@task(ignore_result=True)
def sync_inventory() -> None:
    """Refresh every lab's TPU VMs: one task per lab, each one ListNodes per zone."""
    sync.sync_every_lab()


@task(ignore_result=True)
def sync_lab_inventory(lab_id: int) -> None:
    """Refresh one lab's TPU VMs (the beat's share, or its Refresh button)."""
    if Lab.objects.filter(pk=lab_id).exists():
        sync.sync_lab(lab_id)


@every(settings.PORTAL_RECONCILE_SWEEP_SECONDS, name="reconcile-sweep")
@task(ignore_result=True)
def reconcile_sweep() -> None:
    """Queue again whatever is stuck or lost, and reconcile every VM now and then so
    drift is found and mended."""
    maintenance.requeue_stuck_work()


@every(settings.PORTAL_STALLED_CHECK_SECONDS, name="release-stalled-claims")
@task(ignore_result=True)
def release_stalled_claims() -> None:
    """Run again now the reconciles and disk operations whose holder died."""
    maintenance.rerun_stalled_claims()


@every(settings.PORTAL_DISK_RECHECK_SECONDS, name="disk-recheck")
@task(ignore_result=True)
def recheck_disks() -> None:
    """Reconcile again, within their bounded wait, the VMs whose workers wait for a
    disk's device or still hold a disk being detached."""
    disk_mounts.recheck_due()


@task(ignore_result=True)
def recheck_vm_disks(vm_id: int) -> None:
    """Reconcile the VM again if one of its workers' look at its disks is due (queued
    by the reconcile that found the wait, to run when the look is due)."""
    disk_mounts.recheck_vm(vm_id)


@every(settings.PORTAL_EXPIRY_CHECK_SECONDS, name="expire-grants")
@task(ignore_result=True)
def expire_grants() -> None:
    """Revoke expired grants; warn people a week before their access ends, and the
    lab's admins a week before its TPU grant ends."""
    grants.expire_grants()
    grants.warn_expiring_grants()
    allowances.warn_grant_ending()


@every(settings.PORTAL_SNAPSHOT_EXPIRY_SECONDS, name="expire-snapshots")
@task(ignore_result=True)
def expire_snapshots() -> None:
    """Remove the workdir snapshots no job needs once past their expiry, and the
    contents no snapshot names."""
    snapshots.expire_snapshots()

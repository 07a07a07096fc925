"""The periodic sweeps: which work is stuck or lost, queued again (reconciles,
connection checks, disk operations, host-key scans, looks at a VM's stop, start or
deletion), and which VMs are due a reconcile to find and mend drift."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db.models import Exists, F, Min, OuterRef, Q
from django.utils import timezone

from tpus import queue
from tpus.models import DiskAttachment, Grant, TpuVm, WorkerSync
from tpus.models.grants import GrantState
from tpus.services import (
    connect,
    disk_operations,
    emails,
    hostkey_scans,
    ipchanges,
    reconcile,
    vm_lifecycle,
)


def vms_to_reconcile() -> list[int]:
    """VMs with grants still in flight, workers behind the desired version (whatever
    the change), or, when they hold grants or disks, never reconciled or not for a
    while (drift check)."""
    in_flight = Grant.objects.filter(
        Q(state__in=(GrantState.PENDING, GrantState.REVOKING))
        # Failed on a worker in a way the host may get over (a local account in the
        # way): tried again once its back-off has passed.
        | Q(state=GrantState.FAILED, retry_at__lte=timezone.now())
    ).values_list("vm_id", flat=True)
    stale_before = timezone.now() - dt.timedelta(seconds=settings.PORTAL_DRIFT_CHECK_SECONDS)
    # Something to keep right on the workers: people's accounts, or mounted disks.
    kept = Exists(Grant.objects.filter(vm=OuterRef("pk"))) | Exists(
        DiskAttachment.objects.filter(vm=OuterRef("pk"))
    )
    behind = (
        TpuVm.objects.filter(missing_since=None)
        .annotate(
            oldest=Min("workers__sync__applied_version"),
            last_ok=Min("workers__sync__last_success_at"),
        )
        .filter(
            # A change not applied yet, whatever it was (a disk mounted or unmounted on
            # a VM nobody has access to, the last grant gone): its task may be lost.
            Q(oldest__lt=F("desired_version"))
            | (kept & (Q(oldest__isnull=True) | Q(last_ok__lt=stale_before)))
        )
        .values_list("pk", flat=True)
    )
    return sorted(set(in_flight) | set(behind))


def requeue_stuck_work() -> None:
    """Queue again anything stuck: pending or revoking grants, workers behind, disk
    operations whose worker died, IP-change emails an earlier version left unwritten; and every VM
    due a drift check. Each task re-checks, so queuing twice does no harm."""
    for vm_id in vms_to_reconcile():
        queue.reconcile_vm(vm_id)
    for connection_id, attempt, check in connect.stalled_connections():
        queue.check_vm_connection(connection_id, attempt, check)
    for operation_id in disk_operations.operations_to_resume():
        queue.run_disk_operation(operation_id)
    for notice_id in ipchanges.notices_to_resend():
        emails.send_ip_change_email(notice_id)  # claimed: at most one email per notice
    for scan_id in hostkey_scans.stalled_scans():
        queue.scan_host_keys(scan_id)
    for change_id in vm_lifecycle.lost_changes():
        queue.follow_vm_change(change_id)


def grants_due_a_retry() -> list[int]:
    """VMs with a grant a worker refused for a reason the host may get over, whose
    back-off has passed (``reconcile.retry_delay``): looked for often, so a grant
    heals soon after the admin removes the account in the way, while each VM is
    tried at most once per back-off."""
    return sorted(
        set(
            Grant.objects.filter(state=GrantState.FAILED, retry_at__lte=timezone.now()).values_list(
                "vm_id", flat=True
            )
        )
    )


def workers_due_a_retry() -> list[int]:
    """VMs with a worker that failed for a reason the host can get over (the portal's
    account lost sudo there), whose back-off has passed: it heals soon after the fix,
    not at the next drift sweep."""
    return sorted(
        set(
            WorkerSync.objects.filter(
                retry_at__lte=timezone.now(), worker__vm__missing_since=None
            ).values_list("worker__vm_id", flat=True)
        )
    )


def rerun_stalled_claims() -> None:
    """A reconcile or disk operation whose holder died stops renewing its claim: run
    it again now, instead of waiting for the next sweep. Refused grants and failed
    workers whose next try is due are run too."""
    due = set(grants_due_a_retry()) | set(workers_due_a_retry())
    for vm_id in sorted(set(reconcile.release_stalled_claims()) | due):
        queue.reconcile_vm(vm_id)
    for operation_id in disk_operations.release_stalled_operations():
        queue.run_disk_operation(operation_id)

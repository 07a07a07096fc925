"""Attaching and detaching disks without making the admin's request wait for the
Cloud TPU API's long-running operation: the request checks what it can and queues
the operation; a task runs it and records how it ended."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.models import AuditAction
from tpus.models.inventory import DataDisk, DiskOperation, DiskOperationState, TpuVm
from tpus.services import inventory, leases
from tpus.services.inventory import InventoryError
from tpus.services.leases import Heartbeat


def request_operation(
    admin, disk: DataDisk, vm: TpuVm, action: str, *, mode: str = "READ_ONLY", request=None
) -> DiskOperation:
    """Check, then queue an attach or detach. Bad requests raise InventoryError at
    once and queue nothing; asking again while the same operation waits returns it."""
    if action == DiskOperation.Action.ATTACH:
        inventory.check_attach(disk, vm, mode)
    elif action == DiskOperation.Action.DETACH:
        if disk.lab_id != vm.lab_id:
            raise InventoryError("That disk and VM belong to different labs.")
        if vm.source != "imported":
            raise InventoryError(
                f"{vm.name} was registered by hand; the portal cannot change its disks."
            )
    else:
        raise InventoryError("Unknown disk operation.")
    with transaction.atomic():
        waiting = DiskOperation.objects.filter(
            disk=disk, vm=vm, action=action, state=DiskOperationState.PENDING
        ).first()
        if waiting is not None:
            return waiting
        operation = DiskOperation.objects.create(
            disk=disk, vm=vm, action=action, mode=mode, requested_by=admin
        )
        queue.run_disk_operation(operation.pk)
    return operation


def lease_seconds() -> int:
    """How long a claim lasts unless renewed: the worker running the operation renews
    it (``leases.Heartbeat``) while it waits on the API, so a dead worker's operation is
    picked up again within about a minute, however long the API's operation takes."""
    return int(leases.length().total_seconds())


def _claimable(now) -> Q:
    """Waiting, or running under a lease that ran out (or that an older version of the
    portal never set) because the worker running it died."""
    expired = Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    return Q(state=DiskOperationState.PENDING) | (Q(state=DiskOperationState.RUNNING) & expired)


def _claim(operation_id: int) -> bool:
    """Take the operation with a conditional UPDATE; False when someone else holds it
    or it has finished."""
    now = timezone.now()
    return bool(
        DiskOperation.objects.filter(_claimable(now), pk=operation_id).update(
            state=DiskOperationState.RUNNING,
            claimed_until=now + dt.timedelta(seconds=lease_seconds()),
        )
    )


def release_stalled_operations() -> list[int]:
    """Running operations whose worker stopped renewing the lease (it died): to be run
    again now rather than at the next sweep."""
    now = timezone.now()
    return list(
        DiskOperation.objects.filter(state=DiskOperationState.RUNNING, claimed_until__lt=now)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def operations_to_resume() -> list[int]:
    """Operations the periodic sweep hands to a worker again: running ones whose
    worker's lease ran out, and waiting ones whose task never arrived."""
    now = timezone.now()
    lost_task = Q(
        state=DiskOperationState.PENDING,
        created_at__lt=now - dt.timedelta(seconds=settings.PORTAL_RECONCILE_SWEEP_SECONDS),
    )
    dead_worker = Q(state=DiskOperationState.RUNNING) & (
        Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    )
    return list(
        DiskOperation.objects.filter(lost_task | dead_worker)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def run_operation(operation_id: int) -> None:
    """Claim a waiting (or abandoned) operation and carry it out through the API.
    Attaching and detaching are idempotent, so running one again after a worker died
    half-way ends in the same place."""
    if not _claim(operation_id):
        return
    with Heartbeat(DiskOperation.objects.filter(pk=operation_id), "claimed_until"):
        _carry_out(operation_id)


def _carry_out(operation_id: int) -> None:
    operation = DiskOperation.objects.select_related("disk", "vm__lab", "requested_by").get(
        pk=operation_id
    )
    try:
        if operation.action == DiskOperation.Action.ATTACH:
            inventory.attach_disk(
                operation.requested_by, operation.disk, operation.vm, operation.mode
            )
        else:
            inventory.detach_disk(operation.requested_by, operation.disk, operation.vm)
    except InventoryError as exc:
        DiskOperation.objects.filter(pk=operation_id).update(
            state=DiskOperationState.FAILED,
            error=str(exc)[:2000],
            finished_at=timezone.now(),
            claimed_until=None,
        )
        audit.record(
            AuditAction.DISK_OPERATION_FAILED,
            actor=operation.requested_by,
            lab=operation.vm.lab,
            summary=f"{operation.action} {operation.disk.name} on {operation.vm.name}: {exc}"[:300],
            data={"operation": operation_id},
        )
        return
    DiskOperation.objects.filter(pk=operation_id).update(
        state=DiskOperationState.DONE, finished_at=timezone.now(), claimed_until=None
    )

"""Attaching and detaching disks without making the admin's request wait for the
Cloud TPU API's long-running operation: the request checks what it can and queues
the operation; a task runs it and records how it ended."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from tpus import audit
from tpus.models import AuditAction
from tpus.models.inventory import DataDisk, DiskOperation, DiskOperationState, TpuVm
from tpus.services import inventory
from tpus.services.inventory import InventoryError


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
        from tpus.tasks import run_disk_operation

        run_disk_operation.delay_on_commit(operation.pk)
    return operation


def run_operation(operation_id: int) -> None:
    """Claim a waiting operation and carry it out through the API."""
    claimed = DiskOperation.objects.filter(
        pk=operation_id, state=DiskOperationState.PENDING
    ).update(state=DiskOperationState.RUNNING)
    if not claimed:
        return
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
            state=DiskOperationState.FAILED, error=str(exc)[:2000], finished_at=timezone.now()
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
        state=DiskOperationState.DONE, finished_at=timezone.now()
    )

"""Attaching and detaching disks without making the admin's request wait for the
Cloud TPU API's long-running operation: the request checks what it can and queues
the operation; a task runs it and records how it ended.

A detach goes in two steps, so that no worker is left with a mount whose disk went
away: first the attachment is marked detaching and the workers reconcile (each one
unmounts the disk and drops its fstab line); the operation waits, *unmounting*, until
every worker that may have mounted it has done so, and only then asks the API to
detach. A worker that cannot unmount it (a process holds it) is shown on the
operation with what holds it; it is tried again every PORTAL_DISK_RECHECK_SECONDS,
and after PORTAL_DISK_UNMOUNT_WAIT_SECONDS the detach fails and the disk stays
attached and mounted."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.cloud import CloudError, NodeInfo
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction
from tpus.models.inventory import (
    IN_FLIGHT_OPERATIONS,
    AttachmentState,
    DataDisk,
    DiskAttachment,
    DiskOperation,
    DiskOperationState,
    NodeState,
    TpuVm,
    VmSource,
)
from tpus.services import inventory, leases
from tpus.services.hosts import hosts_must_change
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
        if vm.source == VmSource.MANUAL:
            raise InventoryError(
                f"{vm.name} was registered by hand; the portal cannot change its disks."
            )
    else:
        raise InventoryError("Unknown disk operation.")
    with transaction.atomic():
        # One request at a time per VM decides, so two disks asked for one mount
        # point at once cannot both pass.
        TpuVm.objects.select_for_update().filter(pk=vm.pk).first()
        waiting = DiskOperation.objects.filter(
            disk=disk, vm=vm, action=action, state__in=IN_FLIGHT_OPERATIONS
        ).first()
        if waiting is not None:
            return waiting
        if action == DiskOperation.Action.ATTACH:
            _refuse_point_asked_for(disk, vm)
        operation = DiskOperation.objects.create(
            disk=disk, vm=vm, action=action, mode=mode, requested_by=admin
        )
        queue.run_disk_operation(operation.pk)
    return operation


def _refuse_point_asked_for(disk: DataDisk, vm: TpuVm) -> None:
    """Another disk with the same mount point is on its way to this VM."""
    other = (
        DiskOperation.objects.filter(
            vm=vm,
            action=DiskOperation.Action.ATTACH,
            state__in=IN_FLIGHT_OPERATIONS,
            disk__mount_point=disk.mount_point,
        )
        .exclude(disk=disk)
        .select_related("disk")
        .first()
    )
    if other is not None:
        raise InventoryError(inventory.mount_point_taken(disk, vm, other.disk.name))


def lease_seconds() -> int:
    """How long a claim lasts unless renewed: the worker running the operation renews
    it (``leases.Heartbeat``) while it waits on the API, so a dead worker's operation is
    picked up again within about a minute, however long the API's operation takes."""
    return int(leases.length().total_seconds())


def _claimable(now) -> Q:
    """Waiting (for a worker, or for the VM's workers to unmount the disk), or running
    under a lease that ran out (or that an older version of the portal never set)
    because the worker running it died."""
    expired = Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    waiting = Q(state__in=(DiskOperationState.PENDING, DiskOperationState.UNMOUNTING))
    return waiting | (Q(state=DiskOperationState.RUNNING) & expired)


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
    worker's lease ran out, waiting ones whose task never arrived, and detaches
    waiting for the workers (whose wait may be over)."""
    now = timezone.now()
    lost_task = Q(
        state=DiskOperationState.PENDING,
        created_at__lt=now - dt.timedelta(seconds=settings.PORTAL_RECONCILE_SWEEP_SECONDS),
    ) | Q(state=DiskOperationState.UNMOUNTING)
    dead_worker = Q(state=DiskOperationState.RUNNING) & (
        Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    )
    return list(
        DiskOperation.objects.filter(lost_task | dead_worker)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def run_operation(operation_id: int) -> None:
    """Claim a waiting (or abandoned) operation and take its next step through the API.
    Attaching and detaching are idempotent, so running one again after a worker died
    half-way ends in the same place. While Google works on the change, the step lets
    go of the operation and queues the next look with a countdown: no task waits for
    the API's long-running operation."""
    if not _claim(operation_id):
        return
    with Heartbeat(DiskOperation.objects.filter(pk=operation_id), "claimed_until"):
        pause = _carry_out(operation_id)
    if pause is not None:
        _look_again(operation_id, pause)


def _look_again(operation_id: int, pause: float) -> None:
    """The change is underway at Google: the claim ends when the next look is due, and
    the look is queued for then. Should that task be lost, the lapsed claim is found by
    ``release_stalled_operations`` and the sweep, as a dead worker's is."""
    until = timezone.now() + dt.timedelta(seconds=pause)
    if DiskOperation.objects.filter(pk=operation_id, state=DiskOperationState.RUNNING).update(
        claimed_until=until
    ):
        queue.run_disk_operation(operation_id, countdown=pause)


def _carry_out(operation_id: int) -> float | None:
    """One step; seconds until the next look at the API when the change is underway."""
    operation = DiskOperation.objects.select_related("disk", "vm__lab", "requested_by").get(
        pk=operation_id
    )
    try:
        if operation.action == DiskOperation.Action.ATTACH:
            done = _attached(operation)
        else:
            done = _detached(operation)
        if done is False:
            return None  # waiting for the workers to unmount it
        if done is not True:
            return done
    except InventoryError as exc:
        _failed(operation, str(exc))
        return None
    DiskOperation.objects.filter(pk=operation_id).update(
        state=DiskOperationState.DONE, error="", finished_at=timezone.now(), claimed_until=None
    )
    return None


def _through_api(operation: DiskOperation, begin) -> NodeInfo | float:
    """Send the operation's change (``begin(client)``), or look how the change sent
    earlier goes: the node once it is done, else seconds until the next look. Raises
    InventoryError when the API refused or failed it, or it did not finish within
    TPU_API_OPERATION_TIMEOUT."""
    client = cloud_tpu()
    try:
        if not operation.cloud_operation:
            started = begin(client)
            if started.done:
                return started.node
            DiskOperation.objects.filter(pk=operation.pk).update(
                cloud_operation=started.operation, cloud_started_at=timezone.now()
            )
            return client.next_look_in(0)
        waited = (timezone.now() - operation.cloud_started_at).total_seconds()
        looked = client.look_at_operation(
            operation.cloud_operation, waited=waited, method="UpdateNode"
        )
    except CloudError as exc:
        raise InventoryError(f"The Cloud TPU API refused: {exc}") from None
    return looked.node if looked.done else client.next_look_in(waited)


def _attached(operation: DiskOperation) -> bool | float:
    """One step of an attach: check it and send it, or look how it goes. True once
    attached (and recorded); else seconds until the next look."""
    disk, vm = operation.disk, operation.vm
    if not operation.cloud_operation:
        inventory.check_attach(disk, vm, operation.mode)
    node = _through_api(
        operation,
        lambda client: client.begin_attach_disk(
            vm.lab.gcp_project_id, vm.zone, vm.name, disk.source_disk(), operation.mode
        ),
    )
    if not isinstance(node, NodeInfo):
        return node
    inventory.disk_attached(operation.requested_by, disk, vm, operation.mode, node)
    return True


def _failed(operation: DiskOperation, reason: str) -> None:
    DiskOperation.objects.filter(pk=operation.pk).update(
        state=DiskOperationState.FAILED,
        error=reason[:2000],
        finished_at=timezone.now(),
        claimed_until=None,
    )
    audit.record(
        AuditAction.DISK_OPERATION_FAILED,
        actor=operation.requested_by,
        lab=operation.vm.lab,
        summary=f"{operation.action} {operation.disk.name} on {operation.vm.name}: {reason}"[:300],
        data={"operation": operation.pk},
    )


# Node states in which no host of the VM runs, so nothing can hold the disk mounted.
HOSTS_OFF = (NodeState.STOPPED, NodeState.PREEMPTED, NodeState.TERMINATED)


def _detached(operation: DiskOperation) -> bool | float:
    """One step of a detach: ask the workers to unmount the disk, or look whether they
    all have, or detach it through the API, or look how that goes. True once it is
    detached; False while it waits for the workers; seconds until the next look while
    the API detaches it. Raises InventoryError when it cannot be detached."""
    disk, vm = operation.disk, operation.vm
    attachment = DiskAttachment.objects.filter(disk=disk, vm=vm).first()
    sent = bool(operation.cloud_operation)
    if attachment is not None and vm.state not in HOSTS_OFF and not sent:
        if operation.hosts_version is None:
            with transaction.atomic():
                DiskAttachment.objects.filter(pk=attachment.pk).update(
                    state=AttachmentState.DETACHING
                )
                version = hosts_must_change(vm, f"disk {disk.name} to be detached: unmount it")
                DiskOperation.objects.filter(pk=operation.pk).update(
                    state=DiskOperationState.UNMOUNTING,
                    hosts_version=version,
                    unmount_started_at=timezone.now(),
                    error="",
                    claimed_until=None,
                )
            return False
        holding = still_held(operation, attachment)
        if holding:
            message = "; ".join(holding)
            started = operation.unmount_started_at or operation.created_at
            waited = timezone.now() - started
            if waited < dt.timedelta(seconds=settings.PORTAL_DISK_UNMOUNT_WAIT_SECONDS):
                DiskOperation.objects.filter(pk=operation.pk).update(
                    state=DiskOperationState.UNMOUNTING, error=message[:2000], claimed_until=None
                )
                return False
            _keep_attached(attachment, vm, disk)
            raise InventoryError(
                f"Not detached: {message}. The disk stays attached and mounted; stop what "
                "uses it and detach it again."
            )
    if disk.lab_id != vm.lab_id:
        raise InventoryError("That disk and VM belong to different labs.")
    try:
        node = _through_api(
            operation,
            lambda client: client.begin_detach_disk(
                vm.lab.gcp_project_id, vm.zone, vm.name, disk.source_disk()
            ),
        )
    except InventoryError:
        if attachment is not None:
            _keep_attached(attachment, vm, disk)
        raise
    if not isinstance(node, NodeInfo):
        return node
    inventory.disk_detached(operation.requested_by, disk, vm, node)
    return True


def _keep_attached(attachment: DiskAttachment, vm: TpuVm, disk: DataDisk) -> None:
    """The detach did not happen: the disk is wanted on the workers again."""
    if DiskAttachment.objects.filter(pk=attachment.pk, state=AttachmentState.DETACHING).update(
        state=AttachmentState.ATTACHED
    ):
        hosts_must_change(vm, f"disk {disk.name} stays attached")


def still_held(operation: DiskOperation, attachment: DiskAttachment) -> list[str]:
    """What keeps the disk of a detach on the VM's workers: one line per worker that
    has not unmounted it yet (not reconciled since, unreachable, or busy with what
    holds it). A worker the portal never reached after the disk was attached never
    mounted it and is not waited for."""
    device = operation.disk.name
    held = []
    for worker in operation.vm.workers.select_related("sync").order_by("index"):
        sync = getattr(worker, "sync", None)
        if sync is None or sync.last_success_at is None:
            continue
        if sync.applied_version < operation.hosts_version:
            if sync.last_success_at < attachment.attached_at:
                continue
            why = f" ({sync.last_error})" if sync.last_error else ""
            held.append(f"{worker.alias} has not unmounted it yet{why}")
            continue
        report = sync.last_report or {}
        reasons = [
            reason
            for name, _, reason in (e.partition(":") for e in report.get("mount_error", []))
            if name == device
        ] + list(report.get("disk_error", []))
        held += [f"{worker.alias}: {reason}" for reason in reasons]
    return held

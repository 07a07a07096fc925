"""A TPU VM's data disks on its workers: which disks they mount, what they answered
about each, and the re-checks that follow a disk that is not there yet.

- ``wanted``: the mounts a reconcile sends. Never two disks at one mount point: the
  disk attached first keeps it, the other is a *problem* shown on the VM's page. A
  disk being detached is not mounted any more. A row the hosts must never see (a
  mount point from before a rule was tightened) is a problem too. Problems never stop
  the rest of a reconcile: accounts, keys and revokes go through.
- ``after_run``: what a reconcile's answers mean for the disks. A device the worker
  does not show yet (hot-plug is not instant, and after a reboot it comes back late)
  is looked for again every PORTAL_DISK_RECHECK_SECONDS for up to
  PORTAL_DISK_DEVICE_WAIT_SECONDS, by a task queued to run when the next look is due
  (``recheck_vm``), not by a request that sleeps; so is a disk being detached that a
  worker cannot unmount yet. The beat task (``due_rechecks``) finds the looks whose
  task was lost. Detaches waiting for the workers are handed on.
- ``boot_seen``: a reboot noticed outside a reconcile (a job's status) asks for one.
- ``disk_rows``: each attached disk's state on the VM's page.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.conf import settings
from django.utils import timezone

from tpus import queue
from tpus.models import DiskAttachment, Worker, WorkerSync
from tpus.models.inventory import AttachmentState, DiskMode, DiskOperation, DiskOperationState
from tpus.remote import rules
from tpus.remote.desired import DesiredMount


@dataclass(frozen=True)
class Wanted:
    """The mounts every worker of a VM gets, and why the others are not mounted
    (attachment id → reason)."""

    mounts: tuple[DesiredMount, ...]
    problems: dict[int, str] = field(default_factory=dict)


def attachments_of(vm) -> list[DiskAttachment]:
    """The VM's attachments, the oldest first (the one that keeps a mount point)."""
    return list(
        DiskAttachment.objects.filter(vm=vm).select_related("disk").order_by("attached_at", "pk")
    )


def wanted(attachments: list[DiskAttachment], *, shared: bool) -> Wanted:
    """What the workers mount, from ``attachments`` (oldest first). On a pod
    (``shared``) every disk is mounted read-only, whatever its mode: one filesystem is
    never written from several hosts at once."""
    mounts: list[DesiredMount] = []
    problems: dict[int, str] = {}
    points: dict[str, str] = {}  # mount point -> the disk that has it
    devices: set[str] = set()
    for attachment in attachments:
        if attachment.state != AttachmentState.ATTACHED:
            continue  # being detached: unmounted first, then detached
        disk = attachment.disk
        point = disk.mount_point
        if not rules.is_device(disk.name) or disk.name in devices:
            problems[attachment.pk] = (
                f"Not mounted: {disk.name} is not a disk name the workers accept "
                "(or another disk of this VM has it)."
            )
            continue
        if (problem := rules.mount_point_problem(point)) is not None:
            problems[attachment.pk] = f"Not mounted: {problem}"
            continue
        if point in points:
            problems[attachment.pk] = same_point_message(disk.name, point, points[point])
            continue
        points[point] = disk.name
        devices.add(disk.name)
        mounts.append(
            DesiredMount(
                device=disk.name,
                mount_point=point,
                read_only=shared or attachment.mode == DiskMode.READ_ONLY,
            )
        )
    mounts.sort(key=lambda m: m.device)  # the order of the fstab lines, run after run
    return Wanted(tuple(mounts), problems)


def problems(vm, *, shared: bool) -> list[str]:
    """Why some of the VM's disks are not mounted on any worker, disk by disk."""
    attachments = attachments_of(vm)
    found = wanted(attachments, shared=shared).problems
    return [f"{a.disk.name}: {found[a.pk]}" for a in attachments if a.pk in found]


def same_point_message(name: str, point: str, other: str) -> str:
    return (
        f"Not mounted: {point} is already where {other} is mounted on this VM, and two "
        f"disks cannot share a mount point. Detach {name} (or {other}); the workers' "
        "accounts and keys are kept up to date meanwhile."
    )


# --- after a reconcile -------------------------------------------------------------


def _since(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def _device_wait() -> dt.timedelta:
    return dt.timedelta(seconds=settings.PORTAL_DISK_DEVICE_WAIT_SECONDS)


def _unmount_wait() -> dt.timedelta:
    return dt.timedelta(seconds=settings.PORTAL_DISK_UNMOUNT_WAIT_SECONDS)


def _recheck_in() -> dt.timedelta:
    return dt.timedelta(seconds=settings.PORTAL_DISK_RECHECK_SECONDS)


def late_devices(disk_waits: dict) -> set[str]:
    """The devices of a worker's ``disk_waits`` waited for longer than
    PORTAL_DISK_DEVICE_WAIT_SECONDS: no longer looked for, shown as an error."""
    now = timezone.now()
    devices = (disk_waits or {}).get("devices", {})
    return {d for d, since in devices.items() if now - _since(since) >= _device_wait()}


def late_message(device: str) -> str:
    return (
        f"the disk's device (/dev/disk/by-id/google-{device}) did not appear within "
        f"{settings.PORTAL_DISK_DEVICE_WAIT_SECONDS} s. Is the disk attached to this VM in "
        "the Cloud TPU API? The portal looks again at the next reconcile."
    )


def after_run(vm_id: int, answered: list[int], looked_at: dt.datetime | None = None) -> None:
    """Record, for each worker that answered (``answered``: worker indexes), which
    devices it waits for and since when (a new boot starts the wait again), and when
    to look again: while a device is within its wait, or a disk being detached is
    still held on it, one interval after this look began (``looked_at``: when the
    workers were contacted), and queue that look. Then hand the VM's waiting detaches
    on."""
    now = timezone.now()
    next_look = max((looked_at or now) + _recheck_in(), now)
    queued = False
    unmounting = {
        op.disk.name: op
        for op in DiskOperation.objects.filter(
            vm_id=vm_id, state=DiskOperationState.UNMOUNTING
        ).select_related("disk")
    }
    for sync in WorkerSync.objects.filter(worker__vm_id=vm_id).select_related("worker"):
        if sync.worker.index not in answered:
            # Not reached: the reconcile's own retries and the sweep deal with it.
            if sync.disk_recheck_at is not None:
                WorkerSync.objects.filter(pk=sync.pk).update(disk_recheck_at=None)
            continue
        report = sync.last_report or {}
        boot = str((report.get("values") or {}).get("boot_id", ""))
        before = sync.disk_waits or {}
        known = before.get("devices", {}) if before.get("boot") == boot else {}
        devices = {d: known.get(d, now.isoformat()) for d in report.get("waiting_device", [])}
        waits = {"boot": boot, "devices": devices} if devices else {}
        again = any(now - _since(s) < _device_wait() for s in devices.values())
        for entry in report.get("mount_error", []):
            op = unmounting.get(entry.partition(":")[0])
            started = op.unmount_started_at if op is not None else None
            if started is not None and now - started < _unmount_wait():
                again = True  # a disk being detached is still held here
        recheck = next_look if again else None
        if waits != before or recheck != sync.disk_recheck_at:
            WorkerSync.objects.filter(pk=sync.pk).update(disk_waits=waits, disk_recheck_at=recheck)
        if recheck is not None and not queued:
            queue.recheck_disks(vm_id, (recheck - now).total_seconds())
            queued = True
    for op in unmounting.values():
        queue.run_disk_operation(op.pk)


def due_rechecks(vm_id: int | None = None) -> list[int]:
    """VMs (all, or ``vm_id`` only) to reconcile again now for their disks (claimed:
    the next look is put off by one interval, so a beat or a queued look that comes
    before the run does not queue it twice; the run sets the next look itself)."""
    now = timezone.now()
    vm_ids = set()
    due = WorkerSync.objects.filter(disk_recheck_at__lte=now)
    if vm_id is not None:
        due = due.filter(worker__vm_id=vm_id)
    for pk, found in due.values_list("pk", "worker__vm_id"):
        if WorkerSync.objects.filter(pk=pk, disk_recheck_at__lte=now).update(
            disk_recheck_at=now + _recheck_in()
        ):
            vm_ids.add(found)
    return sorted(vm_ids)


def recheck_due() -> None:
    """Queue the reconciles that ``due_rechecks`` finds (the beat task's work: the
    looks whose queued task was lost)."""
    for vm_id in due_rechecks():
        queue.reconcile_vm(vm_id)


def recheck_vm(vm_id: int) -> None:
    """Reconcile the VM if a look at its disks is due now (the task ``after_run``
    queued for the moment it is due; nothing if the beat took it meanwhile)."""
    if due_rechecks(vm_id):
        queue.reconcile_vm(vm_id)


def boot_seen(worker: Worker, boot_id: str) -> None:
    """A worker answered with a boot id (a job's status, say) other than the one its
    last reconcile saw: it rebooted, and its mounts are checked again now rather
    than at the next drift check. (fstab mounts the disks at boot on a real VM; the
    reconcile confirms it, or waits for a device that comes late.)"""
    if boot_id and worker.boot_id and boot_id != worker.boot_id:
        queue.reconcile_vm(worker.vm_id)


# --- the VM's page -----------------------------------------------------------------


@dataclass
class DiskRow:
    """One attached disk on the VM's page: a badge (ok, pending, failed) and what the
    workers say about it."""

    attachment: DiskAttachment
    badge: str
    state: str
    details: list[str] = field(default_factory=list)


def disk_rows(vm, attachments: list[DiskAttachment] | None = None) -> list[DiskRow]:
    """Each of the VM's disks and how its workers have it: mounted everywhere, not
    mounted (and why), waiting for the device, busy, being detached."""
    attachments = attachments_of(vm) if attachments is None else attachments
    if not attachments:
        return []
    workers = list(vm.workers.select_related("sync").order_by("index"))
    problems = wanted(attachments, shared=len(workers) > 1).problems
    rows = []
    for attachment in sorted(attachments, key=lambda a: a.disk.name):
        device = attachment.disk.name
        if attachment.pk in problems:
            rows.append(DiskRow(attachment, "failed", "not mounted", [problems[attachment.pk]]))
            continue
        details, waiting, late, unchecked = [], [], [], []
        for worker in workers:
            sync = getattr(worker, "sync", None)
            if sync is None or sync.last_success_at is None:
                unchecked.append(worker.alias)
                continue
            report = sync.last_report or {}
            details += [f"{worker.alias}: {e}" for e in report.get("disk_error", [])]
            details += [
                f"{worker.alias}: {reason}"
                for name, _, reason in (e.partition(":") for e in report.get("mount_error", []))
                if name == device
            ]
            if device in report.get("waiting_device", []):
                if device in late_devices(sync.disk_waits):
                    late.append(worker.alias)
                else:
                    waiting.append(worker.alias)
            elif sync.last_success_at < attachment.attached_at:
                unchecked.append(worker.alias)
        if attachment.state == AttachmentState.DETACHING:
            state = "being detached: unmounting on the workers"
            rows.append(DiskRow(attachment, "failed" if details else "pending", state, details))
            continue
        if late:
            details.append(f"{', '.join(late)}: {late_message(device)}")
        if details:
            rows.append(DiskRow(attachment, "failed", "not mounted everywhere", details))
        elif waiting:
            rows.append(
                DiskRow(attachment, "pending", "waiting for the device", [", ".join(waiting)])
            )
        elif unchecked:
            rows.append(DiskRow(attachment, "pending", "not mounted yet", [", ".join(unchecked)]))
        else:
            rows.append(DiskRow(attachment, "ok", "mounted on every worker"))
    return rows

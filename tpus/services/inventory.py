"""Use cases about the lab's TPU VMs and data disks: import from the Cloud TPU API,
register by hand, keep in sync, attach and detach disks.

All API traffic goes through ``tpus.cloud``; every listing is one ListNodes per
(project, zone), never one call per node.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from portal import audit
from tpus.cloud import CloudError, NodeInfo
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction, Lab
from tpus.models.inventory import (
    AttachmentState,
    DataDisk,
    DiskAttachment,
    DiskMode,
    HostKeySource,
    NodeHealth,
    NodeState,
    TpuVm,
    VmSource,
    Worker,
)
from tpus.services import kind_grants
from tpus.services.hosts import hosts_must_change
from tpus.services.ownership import (
    addresses_of_other_labs,
    host_key_taken_message,
    host_keys_pinned_elsewhere,
)

log = logging.getLogger(__name__)


class InventoryError(ValueError):
    """An inventory use case refused; the message is for the admin."""


MANUAL_SITE_ADMIN_ONLY = (
    "Only a site admin can register a TPU VM by hand: import the lab's VMs from its "
    "GCP project instead."
)


def _refuse_keys_pinned_elsewhere(worker: Worker, lines: list[str]) -> None:
    if host_keys_pinned_elsewhere(worker.vm.lab, lines):
        raise InventoryError(host_key_taken_message(worker))


@dataclass(frozen=True)
class Candidate:
    """A node the API lists for the lab, and whether the portal already knows it."""

    node: NodeInfo
    registered: bool

    @property
    def key(self) -> str:
        return f"{self.node.zone}/{self.node.name}"


@dataclass
class ImportPreview:
    candidates: list[Candidate] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # zone -> what the API said
    # Set when no zone can be read at all (no credentials, no permission): one
    # explanation instead of the same error per zone.
    blocking_error: str = ""

    @property
    def zones_read(self) -> list[str]:
        return [zone for zone in self.zones if zone not in self.errors]

    zones: list[str] = field(default_factory=list)


def _blocking(error: CloudError, lab: Lab) -> str:
    """The explanation for an error that every zone would give, or "" for others."""
    if error.code == "UNAUTHENTICATED":
        return (
            "The portal has no usable Google credentials for the Cloud TPU API. Set "
            "TPU_API_CREDENTIALS_FILE to a service-account key file (roles/tpu.viewer on "
            f"{lab.gcp_project_id} to import; roles/tpu.admin to connect VMs and attach "
            "disks), or give the portal application default credentials. To try the "
            "portal without Google, run bin/demo, or point TPU_API_ENDPOINT at the "
            "emulator (docs/emulator.md)."
        )
    if error.code == "PERMISSION_DENIED":
        return (
            f"The portal's Google credentials may not list TPU VMs in {lab.gcp_project_id}: "
            "grant its service account roles/tpu.viewer there (roles/tpu.admin to connect "
            f"VMs and attach disks). The API said: {error.message}"
        )
    return ""


def _choice(value: str, choices) -> str:
    return value if value in choices.values else choices.values[0]


def preview_import(lab: Lab) -> ImportPreview:
    """What the lab's project has in each of its zones (one ListNodes per zone)."""
    preview = ImportPreview(zones=list(lab.zones))
    known = set(TpuVm.objects.filter(lab=lab).values_list("zone", "name"))
    for zone in lab.zones:
        try:
            nodes = cloud_tpu().list_nodes(lab.gcp_project_id, zone)
        except CloudError as exc:
            blocking = _blocking(exc, lab)
            if blocking:  # every other zone would say the same
                preview.blocking_error = blocking
                preview.errors = {z: str(exc) for z in lab.zones}
                return preview
            preview.errors[zone] = str(exc)
            continue
        preview.candidates += [Candidate(n, (n.zone, n.name) in known) for n in nodes]
    return preview


def apply_node(vm: TpuVm, node: NodeInfo) -> list[str]:
    """Copy what the API says onto the VM row; returns the names of fields that changed."""
    values = {
        "accelerator_type": node.accelerator_type,
        "topology": node.topology,
        "runtime_version": node.runtime_version,
        "state": _choice(node.state, NodeState),
        "health": _choice(node.health, NodeHealth),
        "health_description": node.health_description[:500],
        "labels": dict(node.labels),
        "preemptible": node.preemptible or node.spot,
    }
    if node.create_time is not None:
        values["node_created_at"] = node.create_time
    changed = [name for name, value in values.items() if getattr(vm, name) != value]
    for name in changed:
        setattr(vm, name, values[name])
    return changed


def refresh_from_node(vm: TpuVm, node: NodeInfo) -> None:
    """What a stop or start call answered, on the VM's row and its workers."""
    with transaction.atomic():
        apply_node(vm, node)
        vm.save()
        apply_workers(vm, node)


def apply_workers(vm: TpuVm, node: NodeInfo) -> None:
    """Create or update one Worker row per network endpoint. Host keys are not
    touched here: they are pinned once, never refreshed from the API."""
    existing = {w.index: w for w in vm.workers.all()}
    for info in node.workers:
        worker = existing.get(info.index) or Worker(vm=vm, index=info.index)
        worker.internal_ip = info.internal_ip or None
        # A worker under maintenance has no external IP; keep the last known one
        # until a new one appears, so nothing reads a blank as a change.
        if info.external_ip:
            worker.external_ip = info.external_ip
        worker.save()


def pin_from_guest_attributes(vm: TpuVm, node: NodeInfo) -> list[str]:
    """Pin each worker's host keys from guest attributes, for workers not pinned yet.
    This runs at import, before any collaborator has a shell on the VM. A worker whose
    published key is pinned for another lab's worker stays unpinned; the returned
    messages say which."""
    unpinned = {w.index: w for w in vm.workers.select_related("vm__lab") if not w.is_pinned}
    if not unpinned:
        return []
    published = cloud_tpu().guest_host_keys(
        vm.lab.gcp_project_id, node.zone, node.name, workers=sorted(unpinned)
    )
    now = timezone.now()
    refused = []
    for index, worker in unpinned.items():
        lines = sorted(published.for_worker(index).values())
        if lines and host_keys_pinned_elsewhere(vm.lab, lines):
            log.warning("%s publishes a host key pinned for another lab; not pinned", worker)
            refused.append(host_key_taken_message(worker))
        elif lines:
            worker.host_keys = lines
            worker.host_keys_source = HostKeySource.GUEST_ATTRIBUTES
            worker.host_keys_pinned_at = now
            # What was published is what got pinned: the sync compares from here.
            worker.published_host_keys = lines
            worker.published_keys_checked_at = now
            worker.save(
                update_fields=[
                    "host_keys", "host_keys_source", "host_keys_pinned_at",
                    "published_host_keys", "published_keys_checked_at",
                ]
            )  # fmt: skip
    return refused


def apply_disks(vm: TpuVm, node: NodeInfo) -> None:
    """Register the node's data disks and its attachments as the API reports them."""
    attached = set()
    for info in node.data_disks:
        disk, _ = DataDisk.objects.get_or_create(
            lab=vm.lab, zone=info.zone or vm.zone, name=info.name
        )
        DiskAttachment.objects.update_or_create(
            disk=disk, vm=vm, defaults={"mode": _choice(info.mode, DiskMode)}
        )
        attached.add(disk.pk)
    DiskAttachment.objects.filter(vm=vm).exclude(disk_id__in=attached).delete()


def import_vms(admin, lab: Lab, keys: list[str], *, request=None) -> list[TpuVm]:
    """Register the chosen nodes (``"zone/name"`` keys) with their workers, pinned
    host keys and disks. Importing a known VM refreshes it; pins stay as they are.
    Each returned VM's ``host_key_refusals`` lists the workers whose published host
    key was not pinned because another lab's worker has it."""
    wanted: dict[str, set[str]] = defaultdict(set)
    for key in keys:
        zone, _, name = key.partition("/")
        if zone not in lab.zones or not name:
            raise InventoryError(f"{key!r} is not a TPU VM in one of the lab's zones.")
        wanted[zone].add(name)
    imported = []
    for zone, names in sorted(wanted.items()):
        listed = {n.name: n for n in cloud_tpu().list_nodes(lab.gcp_project_id, zone)}
        missing = sorted(names - listed.keys())
        if missing:
            raise InventoryError(f"The API does not list {', '.join(missing)} in {zone}.")
        for name in sorted(names):
            imported.append(_import_one(admin, lab, listed[name], request=request))
    return imported


def register_created(lab: Lab, node: NodeInfo, *, requested_by=None) -> TpuVm:
    """Put a node the portal made for the lab into it, as an import does (workers,
    host keys pinned from guest attributes, disks); a VM of that name that was made
    before (brought back after a preemption) keeps its row, grants and pins."""
    return _import_one(requested_by, lab, node, source=VmSource.CREATED)


def _import_one(
    admin, lab: Lab, node: NodeInfo, *, request=None, source: str = VmSource.IMPORTED
) -> TpuVm:
    with transaction.atomic():
        vm, created = TpuVm.objects.select_for_update().get_or_create(
            lab=lab, zone=node.zone, name=node.name, defaults={"source": source}
        )
        apply_node(vm, node)
        vm.source = source
        vm.last_seen_at = timezone.now()
        vm.missing_since = None
        vm.save()
        apply_workers(vm, node)
        apply_disks(vm, node)
    # Outside the row lock: one more API call, and a failure leaves an unpinned VM
    # that the admin can pin by confirming fingerprints.
    vm.host_key_refusals = []
    try:
        vm.host_key_refusals = pin_from_guest_attributes(vm, node)
    except CloudError as exc:
        log.warning("guest attributes of %s unavailable: %s", vm, exc)
    if vm.attachments.exists() or vm.grants.exists():
        hosts_must_change(vm, "imported again")
    kind_grants.apply_kind_grants(vm)
    if source == VmSource.CREATED:
        return vm  # the request that made it says so in the audit log
    audit.record(
        AuditAction.VM_IMPORTED,
        actor=admin,
        lab=lab,
        summary=f"{vm.name} ({vm.accelerator_type}, {len(node.workers)} workers)",
        data={"vm": vm.pk, "created": created, "host_key_refusals": vm.host_key_refusals},
        request=request,
    )
    return vm


@dataclass(frozen=True)
class ManualWorker:
    internal_ip: str | None
    external_ip: str


def register_manual_vm(
    admin,
    lab: Lab,
    *,
    name: str,
    zone: str,
    accelerator_type: str,
    workers: list[ManualWorker],
    request=None,
) -> TpuVm:
    """Register a VM the API cannot see (site admins only). Its host keys are pinned
    when an admin confirms the fingerprints the portal reads from each worker. An
    address another lab's worker has is refused: it is that lab's machine."""
    if not admin.is_site_admin:
        raise InventoryError(MANUAL_SITE_ADMIN_ONLY)
    if not workers:
        raise InventoryError("Give the external IP of at least one worker.")
    given = {a for w in workers for a in (w.external_ip, w.internal_ip) if a}
    if taken := addresses_of_other_labs(lab, given):
        raise InventoryError(
            f"{', '.join(sorted(taken))} already belongs to a worker of another lab; a TPU "
            "VM registered by hand cannot use it."
        )
    if TpuVm.objects.filter(lab=lab, zone=zone, name=name).exists():
        raise InventoryError(f"{name} in {zone} is already registered.")
    vm = TpuVm(
        lab=lab, name=name, zone=zone, accelerator_type=accelerator_type, source=VmSource.MANUAL
    )
    try:
        vm.full_clean()
    except ValidationError as exc:
        raise InventoryError(" ".join(exc.messages)) from None
    with transaction.atomic():
        vm.save()
        for index, worker in enumerate(workers):
            Worker.objects.create(
                vm=vm,
                index=index,
                internal_ip=worker.internal_ip or None,
                external_ip=worker.external_ip,
            )
    audit.record(
        AuditAction.VM_REGISTERED,
        actor=admin,
        lab=lab,
        summary=f"{vm.name} ({len(workers)} workers)",
        data={"vm": vm.pk},
        request=request,
    )
    # Nothing yet while its host keys wait for an admin (then ``pin_host_keys``).
    kind_grants.apply_kind_grants(vm)
    return vm


def pin_host_keys(admin, worker: Worker, lines: list[str], *, request=None) -> Worker:
    """An admin confirmed these host keys for a worker that has none pinned. A pinned
    worker keeps its keys: changing them is a deliberate re-pin."""
    if not lines:
        raise InventoryError("There are no host keys to pin.")
    _refuse_keys_pinned_elsewhere(worker, lines)
    updated = Worker.objects.filter(pk=worker.pk, host_keys=[]).update(
        host_keys=sorted(lines),
        host_keys_source=HostKeySource.ADMIN,
        host_keys_pinned_at=timezone.now(),
        host_keys_pinned_by=admin,
    )
    worker.refresh_from_db()
    if not updated and sorted(worker.host_keys) != sorted(lines):
        raise InventoryError(f"{worker.alias} already has pinned host keys.")
    audit.record(
        AuditAction.HOST_KEYS_PINNED,
        actor=admin,
        lab=worker.vm.lab,
        summary=worker.alias,
        data={"worker": worker.pk, "keys": sorted(lines)},
        request=request,
    )
    # The last worker pinned makes the VM grantable: its kind's grants come now.
    kind_grants.apply_kind_grants(worker.vm)
    return worker


def register_disk(
    admin, lab: Lab, *, name: str, zone: str, size_gb: int | None, mount_point: str, request=None
) -> DataDisk:
    """Register a data disk of the lab's project (the TPU API does not list disks)."""
    if zone not in lab.zones:
        raise InventoryError(f"{zone} is not one of the lab's zones.")
    disk = DataDisk(lab=lab, name=name, zone=zone, size_gb=size_gb, mount_point=mount_point)
    try:
        disk.full_clean()
    except ValidationError as exc:
        raise InventoryError(" ".join(exc.messages)) from None
    disk.save()
    audit.record(AuditAction.DISK_REGISTERED, actor=admin, lab=lab, summary=name, request=request)
    return disk


def attach_disk(admin, disk: DataDisk, vm: TpuVm, mode: str, *, request=None) -> DiskAttachment:
    """Attach through the API, then record it. Read-only disks attach to many VMs; a
    read-write disk to one. Attaching again in the same mode is success."""
    check_attach(disk, vm, mode)
    try:
        node = cloud_tpu().attach_disk(
            vm.lab.gcp_project_id, vm.zone, vm.name, disk.source_disk(), mode
        )
    except CloudError as exc:
        raise InventoryError(f"The Cloud TPU API refused: {exc}") from None
    return disk_attached(admin, disk, vm, mode, node, request=request)


def disk_attached(
    admin, disk: DataDisk, vm: TpuVm, mode: str, node: NodeInfo, *, request=None
) -> DiskAttachment:
    """The API attached the disk (``node`` as the change left it): record it, and have
    the workers mount it."""
    with transaction.atomic():
        apply_disks(vm, node)
    attachment = DiskAttachment.objects.get(disk=disk, vm=vm)
    hosts_must_change(vm, f"disk {disk.name} attached")
    audit.record(
        AuditAction.DISK_ATTACHED,
        actor=admin,
        lab=vm.lab,
        summary=f"{disk.name} → {vm.name} ({mode})",
        data={"disk": disk.pk, "vm": vm.pk, "mode": mode},
        request=request,
    )
    return attachment


def check_attach(disk: DataDisk, vm: TpuVm, mode: str) -> None:
    """What can be known before asking the API: raises InventoryError with the reason."""
    if mode not in DiskMode.values:
        raise InventoryError("Choose read-only or read-write.")
    if disk.lab_id != vm.lab_id or disk.zone != vm.zone:
        raise InventoryError(f"{disk.name} is in {disk.zone}; it can only attach to VMs there.")
    if vm.source == VmSource.MANUAL:
        raise InventoryError(
            f"{vm.name} was registered by hand; the portal cannot attach disks to it."
        )
    if mode == DiskMode.READ_WRITE and (workers := vm.workers.count()) > 1:
        raise InventoryError(
            f"{vm.name} has {workers} workers, and a disk attached to it is attached to "
            "each of them: attach it read-only (one filesystem written from several hosts "
            "at once would be corrupted)."
        )
    here = vm.attachments.filter(disk=disk).first()
    if here is not None and here.state == AttachmentState.DETACHING:
        raise InventoryError(
            f"{disk.name} is being detached from {vm.name}; attach it again once that is done."
        )
    clash = (
        vm.attachments.filter(disk__mount_point=disk.mount_point)
        .exclude(disk=disk)
        .select_related("disk")
        .first()
    )
    if clash is not None:
        raise InventoryError(mount_point_taken(disk, vm, clash.disk.name))
    others = disk.attachments.exclude(vm=vm)
    if mode == DiskMode.READ_WRITE and others.exists():
        raise InventoryError(
            f"{disk.name} is attached to {others.first().vm.name}; a read-write disk can be "
            "attached to one VM only. Attach it read-only to share it."
        )
    if others.filter(mode=DiskMode.READ_WRITE).exists():
        raise InventoryError(f"{disk.name} is attached read-write elsewhere; detach it first.")


def mount_point_taken(disk: DataDisk, vm: TpuVm, other: str) -> str:
    return (
        f"{other} is already mounted at {disk.mount_point} on {vm.name}, and two disks "
        f"cannot share a mount point on one VM. Detach {other} first, or attach a disk "
        "registered with another mount point."
    )


def detach_disk(admin, disk: DataDisk, vm: TpuVm, *, request=None) -> None:
    """Detach through the API, then forget the attachment. Not attached is success.
    The workers must have unmounted the disk before: ``disk_operations`` runs this
    only once every worker has (a request to detach is a ``DiskOperation``)."""
    if disk.lab_id != vm.lab_id:
        raise InventoryError("That disk and VM belong to different labs.")
    try:
        node = cloud_tpu().detach_disk(vm.lab.gcp_project_id, vm.zone, vm.name, disk.source_disk())
    except CloudError as exc:
        raise InventoryError(f"The Cloud TPU API refused: {exc}") from None
    disk_detached(admin, disk, vm, node, request=request)


def disk_detached(admin, disk: DataDisk, vm: TpuVm, node: NodeInfo, *, request=None) -> None:
    """The API detached the disk (``node`` as the change left it): forget it."""
    with transaction.atomic():
        apply_disks(vm, node)
    hosts_must_change(vm, f"disk {disk.name} detached")
    audit.record(
        AuditAction.DISK_DETACHED,
        actor=admin,
        lab=vm.lab,
        summary=f"{disk.name} ✕ {vm.name}",
        data={"disk": disk.pk, "vm": vm.pk},
        request=request,
    )


def repin_host_keys(admin, worker: Worker, lines: list[str], *, request=None) -> Worker:
    """An admin deliberately replaces a worker's pinned keys (the VM was re-created,
    or it presented a new key that the admin checked). Clears the alert, and the next
    reconcile reaches the worker again."""
    if not lines:
        raise InventoryError("There are no host keys to pin.")
    _refuse_keys_pinned_elsewhere(worker, lines)
    previous = list(worker.host_keys)
    Worker.objects.filter(pk=worker.pk).update(
        host_keys=sorted(lines),
        host_keys_source=HostKeySource.ADMIN,
        host_keys_pinned_at=timezone.now(),
        host_keys_pinned_by=admin,
        host_key_mismatch_at=None,
        presented_host_key="",
        host_key_alarm_published=False,
    )
    worker.refresh_from_db()
    audit.record(
        AuditAction.HOST_KEYS_PINNED,
        actor=admin,
        lab=worker.vm.lab,
        summary=f"{worker.alias} (replaced)",
        data={"worker": worker.pk, "keys": sorted(lines), "previous": previous},
        request=request,
    )
    hosts_must_change(worker.vm, f"{worker.alias}: host keys pinned")
    kind_grants.apply_kind_grants(worker.vm)
    return worker

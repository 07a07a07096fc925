"""API endpoints about a lab's TPU VMs and data disks (lab admins)."""

from __future__ import annotations

from datetime import datetime

from django.shortcuts import get_object_or_404
from ninja import Router, Schema, Status

from portal.schemas import Error
from tpus import access
from tpus.cloud import CloudError
from tpus.models.inventory import DiskMode
from tpus.services import disk_operations, inventory
from tpus.services.inventory import InventoryError

router = Router(tags=["tpu vms"])


class WorkerOut(Schema):
    index: int
    alias: str
    internal_ip: str | None
    external_ip: str | None
    host_keys: list[str]


class VmOut(Schema):
    id: int
    name: str
    zone: str
    accelerator_type: str
    topology: str
    runtime_version: str
    state: str
    health: str
    source: str
    last_seen_at: datetime | None
    missing_since: datetime | None
    workers: list[WorkerOut]

    @staticmethod
    def resolve_workers(obj):
        return obj.workers.all()


class CandidateOut(Schema):
    key: str
    name: str
    zone: str
    accelerator_type: str
    workers: int
    state: str
    registered: bool


class ImportIn(Schema):
    nodes: list[str]


class AttachmentOut(Schema):
    vm: str
    mode: str


class DiskOut(Schema):
    id: int
    name: str
    zone: str
    size_gb: int | None
    mount_point: str
    attachments: list[AttachmentOut]

    @staticmethod
    def resolve_attachments(obj):
        return [{"vm": a.vm.name, "mode": a.mode} for a in obj.attachments.all()]


class AttachIn(Schema):
    vm_id: int
    mode: DiskMode = DiskMode.READ_ONLY


class DetachIn(Schema):
    vm_id: int


@router.get("/labs/{slug}/vms", response=list[VmOut], summary="A lab's TPU VMs")
def list_vms(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return lab.vms.prefetch_related("workers")


@router.get("/labs/{slug}/vms/{vm_id}", response=VmOut, summary="One TPU VM")
def get_vm(request, slug: str, vm_id: int):
    lab = access.get_admin_lab(request.user, slug)
    return access.get_vm_for_admin(request.user, lab, vm_id)


@router.get(
    "/labs/{slug}/import-candidates",
    response={200: list[CandidateOut], 502: Error},
    summary="What the lab's project lists in its zones",
)
def import_candidates(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    preview = inventory.preview_import(lab)
    if preview.errors and not preview.candidates:
        return Status(502, {"detail": "; ".join(f"{z}: {e}" for z, e in preview.errors.items())})
    return [
        {
            "key": c.key,
            "name": c.node.name,
            "zone": c.node.zone,
            "accelerator_type": c.node.accelerator_type,
            "workers": len(c.node.workers),
            "state": c.node.state,
            "registered": c.registered,
        }
        for c in preview.candidates
    ]


@router.post(
    "/labs/{slug}/import",
    response={201: list[VmOut], 400: Error},
    summary='Import nodes ("zone/name") with their workers, host keys and disks',
)
def import_vms(request, slug: str, payload: ImportIn):
    lab = access.get_admin_lab(request.user, slug)
    if not 1 <= len(payload.nodes) <= 500:
        return Status(400, {"detail": "Name between 1 and 500 nodes."})
    try:
        return Status(201, inventory.import_vms(request.user, lab, payload.nodes, request=request))
    except (InventoryError, CloudError) as exc:
        return Status(400, {"detail": str(exc)})


@router.get("/labs/{slug}/disks", response=list[DiskOut], summary="A lab's data disks")
def list_disks(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return lab.disks.prefetch_related("attachments__vm")


class OperationOut(Schema):
    id: int
    action: str
    disk: str
    vm: str
    mode: str
    state: str
    error: str

    @staticmethod
    def resolve_disk(obj):
        return obj.disk.name

    @staticmethod
    def resolve_vm(obj):
        return obj.vm.name


def _disk_operation(request, slug, disk_id, vm_id, action, mode="READ_ONLY"):
    lab = access.get_admin_lab(request.user, slug)
    disk = access.get_disk_for_admin(request.user, lab, disk_id)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    try:
        operation = disk_operations.request_operation(
            request.user, disk, vm, action, mode=mode, request=request
        )
    except InventoryError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(202, operation)


@router.post(
    "/labs/{slug}/disks/{disk_id}/attach",
    response={202: OperationOut, 400: Error},
    summary="Attach a data disk to a TPU VM (queued; poll the operation)",
)
def attach(request, slug: str, disk_id: int, payload: AttachIn):
    return _disk_operation(request, slug, disk_id, payload.vm_id, "attach", payload.mode)


@router.post(
    "/labs/{slug}/disks/{disk_id}/detach",
    response={202: OperationOut, 400: Error},
    summary="Detach a data disk from a TPU VM (queued; poll the operation)",
)
def detach(request, slug: str, disk_id: int, payload: DetachIn):
    return _disk_operation(request, slug, disk_id, payload.vm_id, "detach")


@router.get(
    "/labs/{slug}/disks/{disk_id}/operations/{operation_id}",
    response=OperationOut,
    summary="One attach or detach request and how it ended",
)
def get_operation(request, slug: str, disk_id: int, operation_id: int):
    lab = access.get_admin_lab(request.user, slug)
    disk = access.get_disk_for_admin(request.user, lab, disk_id)
    return get_object_or_404(disk.operations.select_related("disk", "vm"), pk=operation_id)

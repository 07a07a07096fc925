"""API endpoints about a lab's TPU VMs and data disks (lab admins)."""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from django.db.models import Prefetch, prefetch_related_objects
from django.shortcuts import get_object_or_404
from ninja import Query, Router, Schema, Status
from ninja.pagination import paginate
from pydantic import BaseModel, model_validator

from portal.pagination import KeysetPagination, parse_choice
from portal.schemas import Error
from tpus import access
from tpus.api import filters as api_filters
from tpus.api.chips import ChipsOut
from tpus.api.docs import PAGED, filter_help
from tpus.cloud import CloudError
from tpus.models import TpuVm, Worker
from tpus.models.inventory import DiskMode, NodeState, worker_alias
from tpus.services import (
    chip_metrics,
    connect,
    disk_operations,
    hostkey_alarms,
    inventory,
    sync_health,
    usage,
)
from tpus.services.inventory import InventoryError

router = Router(tags=["tpu vms"])
# Workers with what they last did, in one query for any number of VMs.
_WORKERS = Prefetch("workers", queryset=Worker.objects.select_related("sync"))


class WorkerSummaryOut(BaseModel):
    """A worker in a list of VMs: where it is and how its last reconcile went (its host
    keys are in the VM's own object, ``GET …/vms/{id}``). A plain pydantic model, built
    from ``of``'s dict: a page of pods has hundreds of workers, and a ninja ``Schema``
    would read each field of each through its resolver machinery."""

    index: int
    alias: str
    internal_ip: str | None
    external_ip: str | None
    # Set while provisioning of this worker is stopped because it presented (or the
    # Cloud TPU API published) a host key other than the pinned one.
    host_key_alarm_since: datetime | None
    # What the worker did in the last reconcile.
    applied_version: int | None
    last_success_at: datetime | None
    last_error: str
    last_error_retryable: bool

    @model_validator(mode="before")
    @classmethod
    def _from_worker(cls, obj):
        return cls.of(obj) if isinstance(obj, Worker) else obj

    @staticmethod
    def of(worker: Worker) -> dict:
        """The fields, read once from the worker and its last reconcile."""
        sync = worker.last_sync
        return {
            "index": worker.index,
            "alias": worker.alias,
            "internal_ip": worker.internal_ip,
            "external_ip": worker.external_ip,
            "host_key_alarm_since": worker.host_key_mismatch_at,
            "applied_version": sync.applied_version if sync else None,
            "last_success_at": sync.last_success_at if sync else None,
            "last_error": sync.last_error if sync else "",
            "last_error_retryable": bool(sync and sync.last_error_retryable),
        }

    # What ``of_row`` reads: the worker's columns and its last reconcile's (all None
    # before any reconcile reached it), as ``values()`` names them.
    COLUMNS: ClassVar[tuple[str, ...]] = (
        "vm_id",
        "index",
        "internal_ip",
        "external_ip",
        "host_key_mismatch_at",
        "sync__applied_version",
        "sync__last_success_at",
        "sync__last_error",
        "sync__last_error_retryable",
    )

    @staticmethod
    def of_row(row: dict, vm_name: str) -> dict:
        """The same fields as ``of``, from a plain row of ``COLUMNS``: a page of VMs
        reads hundreds of workers, and needs no model object for any of them."""
        return {
            "index": row["index"],
            "alias": worker_alias(vm_name, row["index"]),
            "internal_ip": row["internal_ip"],
            "external_ip": row["external_ip"],
            "host_key_alarm_since": row["host_key_mismatch_at"],
            "applied_version": row["sync__applied_version"],
            "last_success_at": row["sync__last_success_at"],
            "last_error": row["sync__last_error"] or "",
            "last_error_retryable": bool(row["sync__last_error_retryable"]),
        }


class WorkerOut(WorkerSummaryOut):
    """A worker of one VM, with its pinned host keys and the key it presented."""

    host_keys: list[str]
    presented_host_key: str

    @staticmethod
    def of(worker: Worker) -> dict:
        return {
            **WorkerSummaryOut.of(worker),
            "host_keys": worker.host_keys,
            "presented_host_key": worker.presented_host_key,
        }


class ZoneSyncOut(Schema):
    """How listing one zone from the Cloud TPU API went."""

    zone: str
    failing: bool
    failing_since: datetime | None
    last_success_at: datetime | None
    last_failure_at: datetime | None
    last_error: str


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
    # The last listing of the VM's zone: while it fails, state and addresses are the
    # last ones seen.
    sync: ZoneSyncOut
    workers: list[WorkerOut]
    # Each chip's HBM and duty cycle as the job poll last read them, and who holds it.
    chips: ChipsOut

    @staticmethod
    def resolve_workers(obj):
        return [WorkerOut.of(w) for w in obj.workers.all()]

    @staticmethod
    def resolve_chips(obj):
        return chip_metrics.as_api(
            obj, getattr(obj, "running_job", None), chip_metrics.duty_means([obj.pk])
        )

    @staticmethod
    def resolve_sync(obj):
        return _zone_sync_of(obj)


def _zone_sync_of(vm) -> dict:
    """``ZoneSyncOut`` of the VM's zone. A list is annotated in its own query
    (``sync_health.with_zone_sync``); one VM alone reads its zone's row."""
    if hasattr(vm, "sync_failing_since"):
        values = {name: getattr(vm, f"sync_{name}") for name in sync_health.SYNC_FIELDS}
    else:
        row = sync_health.for_vm(vm)
        values = {name: getattr(row, name) for name in sync_health.SYNC_FIELDS}
    values["last_error"] = values["last_error"] or ""
    return {"zone": vm.zone, "failing": values["failing_since"] is not None, **values}


class VmListItemOut(BaseModel):
    """A VM in a list: its workers without their host keys, and without its chips'
    metrics (both are in the VM's own object), so a page of pods stays small."""

    # ``VmOut``'s fields, in its order. A plain pydantic model filled by ``of``: a
    # ninja ``Schema`` would read each field of each VM through its resolver machinery.
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
    sync: ZoneSyncOut
    workers: list[WorkerSummaryOut]

    # What ``of`` reads of the VM (with ``with_zone_sync``'s annotations).
    COLUMNS: ClassVar[tuple[str, ...]] = (
        "name",
        "zone",
        "accelerator_type",
        "topology",
        "runtime_version",
        "state",
        "health",
        "source",
        "last_seen_at",
        "missing_since",
    )

    @staticmethod
    def of(vm, workers: list[dict]) -> dict:
        """The fields of ``vm``; ``workers`` are its rows of ``WorkerSummaryOut.COLUMNS``."""
        return {
            "id": vm.pk,
            **{name: getattr(vm, name) for name in VmListItemOut.COLUMNS},
            "sync": _zone_sync_of(vm),
            "workers": [WorkerSummaryOut.of_row(row, vm.name) for row in workers],
        }


def vm_list_items(vms: list) -> list[dict]:
    """A page of VMs as ``VmListItemOut`` reads them, with every worker of theirs and
    its last reconcile in one query of plain rows, in index order."""
    rows: dict[int, list[dict]] = {}
    workers = Worker.objects.filter(vm__in=vms).order_by("vm_id", "index")
    for row in workers.values(*WorkerSummaryOut.COLUMNS):
        rows.setdefault(row["vm_id"], []).append(row)
    return [VmListItemOut.of(vm, rows.get(vm.pk, [])) for vm in vms]


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
    state: str  # attached, or detaching (being unmounted on the workers first)


class DiskOut(Schema):
    id: int
    name: str
    zone: str
    size_gb: int | None
    mount_point: str
    attachments: list[AttachmentOut]

    @staticmethod
    def resolve_attachments(obj):
        return [{"vm": a.vm.name, "mode": a.mode, "state": a.state} for a in obj.attachments.all()]


class AttachIn(Schema):
    vm_id: int
    mode: DiskMode = DiskMode.READ_ONLY


class DetachIn(Schema):
    vm_id: int


@router.get(
    "/labs/{slug}/vms",
    response=list[VmListItemOut],
    summary="A lab's TPU VMs",
    description=PAGED + " Without `limit`, 20 VMs a page: each carries all its workers.",
)
@paginate(KeysetPagination, default_limit=20, prepare=vm_list_items)
def list_vms(
    request,
    slug: str,
    state: str | None = Query(None, description=filter_help("state", NodeState)),
    zone: str | None = Query(None, description=filter_help("zone")),
    vm: str | None = Query(None, description=filter_help("vm")),
):
    lab = access.get_admin_lab(request.user, slug)
    vms = TpuVm.objects.filter(lab=lab).only(*VmListItemOut.COLUMNS)
    if state := parse_choice(state, NodeState, "state"):
        vms = vms.filter(state=state)
    if zone := api_filters.lab_zone(lab, zone):
        vms = vms.filter(zone=zone)
    if (one := api_filters.lab_vm(lab, vm)) is not None:
        vms = vms.filter(pk=one.pk)
    return sync_health.with_zone_sync(vms)


@router.get("/labs/{slug}/vms/{vm_id}", response=VmOut, summary="One TPU VM")
def get_vm(request, slug: str, vm_id: int):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    prefetch_related_objects([vm], _WORKERS)
    vm.running_job = usage.running_job(vm)
    return vm


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


@router.get(
    "/labs/{slug}/disks", response=list[DiskOut], summary="A lab's data disks", description=PAGED
)
@paginate(KeysetPagination)
def list_disks(
    request,
    slug: str,
    zone: str | None = Query(None, description=filter_help("zone")),
    vm: str | None = Query(None, description="Only disks attached to this TPU VM: id or name."),
):
    lab = access.get_admin_lab(request.user, slug)
    disks = lab.disks.prefetch_related("attachments__vm")
    if zone := api_filters.lab_zone(lab, zone):
        disks = disks.filter(zone=zone)
    if (attached_to := api_filters.lab_vm(lab, vm)) is not None:
        disks = disks.filter(attachments__vm=attached_to)
    return disks


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


class ConnectionOut(Schema):
    state: str
    reason: str
    workers: dict[str, dict[str, str]]
    finished_at: datetime | None
    public_key_line: str
    gcloud_command: str


def _connection_out(vm):
    connection = connect.connection_of(vm)
    manual = connect.manual_route(vm)
    return {
        "state": connection.state,
        "reason": connection.reason,
        "workers": connection.workers,
        "finished_at": connection.finished_at,
        "public_key_line": manual.line,
        "gcloud_command": manual.command,
    }


@router.get(
    "/labs/{slug}/vms/{vm_id}/connection",
    response=ConnectionOut,
    summary="Whether every worker accepts the lab's key, and how to connect by hand",
)
def get_connection(request, slug: str, vm_id: int):
    lab = access.get_admin_lab(request.user, slug)
    return _connection_out(access.get_vm_for_admin(request.user, lab, vm_id))


def _connection_change(request, slug, vm_id, action):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    try:
        action(request.user, vm, request=request)
    except connect.ConnectError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(202, _connection_out(vm))


@router.post(
    "/labs/{slug}/vms/{vm_id}/connect",
    response={202: ConnectionOut, 400: Error},
    summary="Add the lab's key to the VM's ssh-keys metadata (then poll the connection)",
)
def connect_vm(request, slug: str, vm_id: int):
    return _connection_change(request, slug, vm_id, connect.connect_vm)


@router.post(
    "/labs/{slug}/vms/{vm_id}/disconnect",
    response={202: ConnectionOut, 400: Error},
    summary="Remove the lab's key line from the VM's ssh-keys metadata",
)
def disconnect_vm(request, slug: str, vm_id: int):
    return _connection_change(request, slug, vm_id, connect.disconnect_vm)


@router.post(
    "/labs/{slug}/vms/{vm_id}/workers/{index}/resume",
    response={200: WorkerOut, 409: Error},
    summary="End a worker's host key alarm and reconcile (the key is checked again)",
)
def resume_worker(request, slug: str, vm_id: int, index: int):
    lab = access.get_admin_lab(request.user, slug)
    worker = access.get_worker_for_admin(request.user, lab, vm_id, index)
    if not hostkey_alarms.resume_after_alarm(request.user, worker, request=request):
        return Status(409, {"detail": f"{worker.alias} has no host key alarm."})
    return Status(200, worker)

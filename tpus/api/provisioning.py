"""API endpoints for TPU VMs the portal makes (lab admins): requests, their states and
cancel, the lab's allowance (set by site admins), and stop, start, delete."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404
from ninja import Router, Schema, Status
from ninja.pagination import paginate

from portal.pagination import KeysetPagination
from tpus import access
from tpus.api.docs import PAGED
from tpus.models import VmRequest
from tpus.services import allowances, vm_lifecycle, vm_requests

router = Router(tags=["tpu vms"])


class VmRequestIn(Schema):
    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    provisioning: str = "on-demand"
    queued: bool = False
    valid_after: datetime | None = None
    valid_until: datetime | None = None
    keep_alive: bool = False


class VmRequestOut(Schema):
    id: int
    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    provisioning: str
    queued: bool
    keep_alive: bool
    valid_after: datetime | None
    valid_until: datetime | None
    state: str
    error_code: str
    error: str
    vm_id: int | None
    # A VM kept alive that Google took back and the portal did not ask for again: why
    # (the lab's allowance, its grant's end) and since when; empty and null otherwise.
    kept_down: str
    kept_down_since: datetime | None
    created_at: datetime
    waiting_since: datetime | None
    ready_at: datetime | None
    changed_at: datetime


class AllowanceOut(Schema):
    generation: str
    provisioning: str
    chips: int
    used: int
    left: int


class AllowanceIn(Schema):
    generation: str
    provisioning: str
    chips: int


class DeleteIn(Schema):
    name: str


class Refusal(Schema):
    detail: str
    fields: dict[str, list[str]] = {}


def _refusal(exc: ValidationError):
    fields = exc.message_dict if hasattr(exc, "error_dict") else {}
    return Status(400, {"detail": " ".join(exc.messages), "fields": fields})


@router.get(
    "/labs/{slug}/vm-requests",
    response=list[VmRequestOut],
    summary="The lab's requests for TPU VMs, in the order they were made",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_requests(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return VmRequest.objects.filter(lab=lab)


@router.post(
    "/labs/{slug}/vm-requests",
    response={201: VmRequestOut, 400: Refusal},
    summary="Ask for a TPU VM (made now, or queued until capacity comes)",
)
def create_request(request, slug: str, payload: VmRequestIn):
    lab = access.get_admin_lab(request.user, slug)
    try:
        made = vm_requests.request_vm(
            request.user, lab, vm_requests.VmSpec(**payload.dict()), request=request
        )
    except ValidationError as exc:
        return _refusal(exc)
    return Status(201, made)


@router.get("/labs/{slug}/vm-requests/{request_id}", response=VmRequestOut, summary="One request")
def get_request(request, slug: str, request_id: int):
    lab = access.get_admin_lab(request.user, slug)
    return get_object_or_404(VmRequest, lab=lab, pk=request_id)


@router.post(
    "/labs/{slug}/vm-requests/{request_id}/cancel",
    response={200: VmRequestOut, 400: Refusal},
    summary="Cancel an open request (its queued resource is deleted at Google)",
)
def cancel_request(request, slug: str, request_id: int):
    lab = access.get_admin_lab(request.user, slug)
    made = get_object_or_404(VmRequest, lab=lab, pk=request_id)
    try:
        return vm_requests.cancel_request(request.user, made, request=request)
    except ValidationError as exc:
        return _refusal(exc)


@router.post(
    "/labs/{slug}/vm-requests/{request_id}/retry",
    response={201: VmRequestOut, 400: Refusal},
    summary="Ask again for what a failed or cancelled request asked for (a new request)",
)
def retry_request(request, slug: str, request_id: int):
    lab = access.get_admin_lab(request.user, slug)
    made = get_object_or_404(VmRequest, lab=lab, pk=request_id)
    try:
        return Status(201, vm_requests.retry_request(request.user, made, request=request))
    except ValidationError as exc:
        return _refusal(exc)


@router.get(
    "/labs/{slug}/allowances",
    response=list[AllowanceOut],
    summary="What the lab may hold at once, and what it holds now",
)
def list_allowances(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return [{**use.__dict__, "left": use.left} for use in allowances.allowance_use(lab)]


@router.put(
    "/labs/{slug}/allowances",
    response={200: list[AllowanceOut], 400: Refusal},
    summary="Set one line of the lab's allowance (site admins; 0 chips removes it)",
)
def set_allowance(request, slug: str, payload: AllowanceIn):
    lab = access.get_lab_for_site_admin(request.user, slug, allowances.ALLOWANCE_SITE_ADMIN_ONLY)
    try:
        allowances.set_allowance(
            request.user, lab, payload.generation, payload.provisioning, payload.chips,
            request=request,
        )  # fmt: skip
    except ValidationError as exc:
        return _refusal(exc)
    return [{**use.__dict__, "left": use.left} for use in allowances.allowance_use(lab)]


def _change(request, slug: str, vm_id: int, change, *args):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    try:
        vm = change(request.user, vm, *args, request=request)
    except ValidationError as exc:
        return _refusal(exc)
    return Status(202, {"id": vm.pk, "name": vm.name, "state": vm.state})


class ChangeOut(Schema):
    id: int
    name: str
    state: str


@router.post(
    "/labs/{slug}/vms/{vm_id}/stop",
    response={202: ChangeOut, 400: Refusal},
    summary="Stop a TPU VM (its running jobs are cancelled; runs in the background)",
)
def stop_vm(request, slug: str, vm_id: int):
    return _change(request, slug, vm_id, vm_lifecycle.stop_vm)


@router.post(
    "/labs/{slug}/vms/{vm_id}/start",
    response={202: ChangeOut, 400: Refusal},
    summary="Start a stopped TPU VM (runs in the background)",
)
def start_vm(request, slug: str, vm_id: int):
    return _change(request, slug, vm_id, vm_lifecycle.start_vm)


@router.post(
    "/labs/{slug}/vms/{vm_id}/delete",
    response={202: ChangeOut, 400: Refusal},
    summary="Delete a TPU VM: give its name to confirm. Everyone with access is told.",
)
def delete_vm(request, slug: str, vm_id: int, payload: DeleteIn):
    return _change(request, slug, vm_id, vm_lifecycle.delete_vm, payload.name)

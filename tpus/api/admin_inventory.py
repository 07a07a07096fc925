"""API endpoints for what a lab admin does on the lab's TPU VMs page: "Refresh" from
the Cloud TPU API, register a data disk, and (site admins) register a TPU VM by hand.
Found through ``tpus.access``, checked by the page's own forms, changed through the
same services (see ``tpus.api.admin``)."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Prefetch, prefetch_related_objects
from django.utils import timezone
from ninja import Router, Schema, Status

from tpus import access, queue
from tpus.api.forms import FormError, StrictIn, refusal, refused
from tpus.api.inventory import DiskOut, VmOut, ZoneSyncOut
from tpus.forms.inventory import DiskForm, ManualVmForm
from tpus.models import Worker
from tpus.services import inventory, sync_health
from tpus.services.inventory import InventoryError

router = Router(tags=["lab admin"])


class RefreshOut(Schema):
    detail: str
    queued_at: datetime
    # Each zone's last listing before this refresh: poll GET /labs/{slug} until each
    # zone's last_success_at or last_failure_at is after queued_at.
    sync: list[ZoneSyncOut]


_SYNC_SHOWN = ("zone", "failing_since", "last_success_at", "last_failure_at", "last_error")


@router.post(
    "/labs/{slug}/refresh",
    response={202: RefreshOut},
    summary="List the lab's TPU VMs from the Cloud TPU API now (queued; lab admins)",
)
def refresh(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    queue.refresh_lab(lab.pk)
    return Status(
        202,
        {
            "detail": "Refreshing from the Cloud TPU API.",
            "queued_at": timezone.now(),
            "sync": [
                {"failing": row.failing, **{name: getattr(row, name) for name in _SYNC_SHOWN}}
                for row in sync_health.for_lab(lab)
            ],
        },
    )


class DiskIn(StrictIn):
    name: str
    zone: str
    size_gb: int | None = None
    mount_point: str = "/ssd"


@router.post(
    "/labs/{slug}/disks/register",
    response={201: DiskOut, 400: FormError},
    summary="Register a data disk of the lab's project (lab admins)",
)
def register_disk(request, slug: str, payload: DiskIn):
    lab = access.get_admin_lab(request.user, slug)
    form = DiskForm(payload.dict(), lab=lab)
    if not form.is_valid():
        return refused(form)
    try:
        disk = inventory.register_disk(request.user, lab, request=request, **form.cleaned_data)
    except InventoryError as exc:
        return refusal(str(exc))
    return Status(201, disk)


class ManualWorkerIn(StrictIn):
    external_ip: str
    internal_ip: str | None = None


class ManualVmIn(StrictIn):
    name: str
    zone: str
    accelerator_type: str
    # In worker order: worker 0 first.
    workers: list[ManualWorkerIn]


def _worker_lines(workers: list[ManualWorkerIn]) -> str:
    """The page's one line per worker: "external [internal]". A value with a space in
    it would read as two addresses there, and an empty external IP as no worker: each
    stays one word here for the form to refuse, so line N is always worker N-1."""

    def word(address: str | None) -> str:
        return "_".join((address or "").split())

    return "\n".join(
        f"{word(w.external_ip) or '?'} {word(w.internal_ip)}".rstrip() for w in workers
    )


@router.post(
    "/labs/{slug}/vms/register",
    response={201: VmOut, 400: FormError},
    summary="Register a TPU VM the Cloud TPU API does not list, by its workers' addresses "
    "(site admins)",
)
def register_vm(request, slug: str, payload: ManualVmIn):
    lab = access.get_lab_for_site_admin(request.user, slug, inventory.MANUAL_SITE_ADMIN_ONLY)
    data = {**payload.dict(), "workers": _worker_lines(payload.workers)}
    form = ManualVmForm(data, lab=lab)
    if not form.is_valid():
        return refused(form)
    try:
        vm = inventory.register_manual_vm(request.user, lab, request=request, **form.cleaned_data)
    except InventoryError as exc:
        return refusal(str(exc))
    prefetch_related_objects(
        [vm], Prefetch("workers", queryset=Worker.objects.select_related("sync"))
    )
    return Status(201, vm)

"""API endpoints of the lab's pool of TPU VMs: run a job on any free VM of a kind
("any free v4-8"), list the jobs waiting for one, follow and cancel one by its id
alone within the lab."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q
from ninja import Router, Status

from portal.schemas import Error
from tpus import access
from tpus.api.jobs import (
    JobCheckOut,
    JobError,
    JobIn,
    JobOut,
    JobSummaryOut,
    _admin_of_labs,
    _pool_lines,
    _reloaded,
)
from tpus.models import Job
from tpus.models.jobs import WAITING_STATES
from tpus.services import jobs as job_services
from tpus.services import scheduler
from tpus.services.jobs import Kind

router = Router(tags=["jobs"])


class PoolJobIn(JobIn):
    """A job for any free VM of a kind of the lab: ``accelerator_type`` (``v4-8``),
    optionally ``zones`` (any of them) and ``provisioning`` (``any``, ``on_demand`` or
    ``spot``), with the fields of a job on one VM. It waits without a VM until one of
    the kind on which you have access in force is free; then it runs there as any job
    of that VM does."""

    accelerator_type: str
    zones: list[str] = []
    provisioning: str = "any"

    def kind(self) -> Kind:
        return Kind(self.accelerator_type, tuple(self.zones), self.provisioning)


class PoolJobSummaryOut(JobSummaryOut):
    """A job waiting for a VM of its kind, as the pool's list shows it: with its place
    in its kind's line (1: next), in the order placement serves it (fair share, the
    jobs back from a lost VM first)."""

    position: int | None

    @staticmethod
    def resolve_position(obj, context):
        line = _pool_lines(context, obj.lab_id).get(obj.pk)
        return line.place if line else None


def _refused(exc: ValidationError):
    errors = exc.message_dict if hasattr(exc, "error_dict") else {}
    return Status(400, {"detail": " ".join(exc.messages), "errors": errors})


@router.post(
    "/labs/{slug}/jobs",
    response={201: JobOut, 400: JobError, 403: Error},
    summary="Queue a job on any free TPU VM of a kind (the lab's pool)",
    description="Refused (403) without access in force on at least one VM of the kind in "
    "the lab; the job's `vm_id` is null until it is placed, and its `reason` says why it "
    "waits.",
)
def submit_pool_job(request, slug: str, payload: PoolJobIn):
    lab = access.get_member_lab(request.user, slug)
    try:
        job = job_services.submit_pool_job(
            request.user, lab, payload.kind(), payload.spec(), request=request
        )
    except ValidationError as exc:
        return _refused(exc)
    return Status(201, _reloaded(job))


@router.post(
    "/labs/{slug}/jobs/validate",
    response={200: JobCheckOut, 400: JobError, 403: Error},
    summary="Check a job for the pool as queueing it would, and store nothing",
)
def validate_pool_job(request, slug: str, payload: PoolJobIn):
    lab = access.get_member_lab(request.user, slug)
    try:
        job_services.submit_pool_job(
            request.user, lab, payload.kind(), payload.spec(), dry_run=True
        )
    except ValidationError as exc:
        return _refused(exc)
    what = payload.accelerator_type.strip()
    return Status(200, {"ok": True, "detail": f"A job for any free {what} would be queued."})


@router.get(
    "/labs/{slug}/jobs",
    response=list[PoolJobSummaryOut],
    summary="The jobs waiting for a VM of the lab's pool",
    description="Jobs submitted to a kind that no VM has taken yet, per kind, first in line "
    "first (placement serves each kind's line by fair share), each with why it waits "
    "and its place in its kind's line (`position`, 1: next). "
    "The lab's admins see everyone's; others their own and the others' that wait for a "
    "kind they asked for too.",
)
def list_pool_jobs(request, slug: str):
    lab = access.get_member_lab(request.user, slug)
    jobs = Job.objects.filter(lab=lab, vm__isnull=True, state__in=WAITING_STATES)
    is_admin = access.is_lab_admin(request.user, lab)
    _admin_of_labs(request)[lab.pk] = is_admin
    if not is_admin:
        mine = jobs.filter(user=request.user).values("accelerator_type")
        jobs = jobs.filter(Q(user=request.user) | Q(accelerator_type__in=mine))
    jobs = list(jobs.select_related("user__unix_account").order_by("queued_at", "id")[:1000])
    # In the order placement serves them (fair share), read once for the whole list.
    lines = request.__dict__.setdefault("_pool_lines", {})
    lines[lab.pk] = scheduler.waiting_lines(lab.pk)
    far = len(jobs) + 1
    return sorted(jobs, key=lambda job: (job.accelerator_type, _place(lines[lab.pk], job, far)))


def _place(lines: dict, job: Job, far: int) -> int:
    line = lines.get(job.pk)
    return line.place if line else far


@router.get(
    "/labs/{slug}/jobs/{job_id}",
    response=JobOut,
    summary="A job of the lab by its id alone (placed or still waiting for a VM)",
)
def get_lab_job(request, slug: str, job_id: int):
    lab = access.get_member_lab(request.user, slug)
    return access.get_lab_job_for_viewer(request.user, lab, job_id)


@router.post(
    "/labs/{slug}/jobs/{job_id}/cancel",
    response={200: JobOut, 409: Error},
    summary="Cancel a job by its id alone (its owner and the lab's admins)",
)
def cancel_lab_job(request, slug: str, job_id: int):
    lab = access.get_member_lab(request.user, slug)
    job = access.get_lab_job_for_viewer(request.user, lab, job_id)
    if not access.may_cancel_job(request.user, job):
        raise PermissionDenied(access.CANCEL_REFUSED)
    if not job.can_cancel:
        return Status(409, {"detail": f"The job is {job.state}; there is nothing to cancel."})
    job_services.cancel_job(job, request.user, request=request)
    return Status(200, _reloaded(job))

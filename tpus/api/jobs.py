"""API endpoints about jobs on TPU VMs: run one, list a VM's, follow one, cancel, run
again, download a worker's whole log, and the lab's TPU usage."""

from __future__ import annotations

from datetime import date, datetime

from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q
from django.http import StreamingHttpResponse
from django.urls import reverse
from ninja import Query, Router, Schema, Status
from ninja.errors import HttpError
from ninja.pagination import paginate
from pydantic import BaseModel

from portal.pagination import (
    KeysetPagination,
    decode_cursor,
    next_url,
    parse_choice,
    parse_limit,
    parse_since,
    refuse_unknown_parameters,
)
from portal.schemas import Error
from tpus import access
from tpus.api import filters as api_filters
from tpus.api.chips import ChipsOut
from tpus.api.docs import PAGED, filter_help
from tpus.models import Job
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState
from tpus.services import chip_metrics, job_logs, scheduler, usage
from tpus.services import jobs as job_services
from tpus.services.jobs import JobSpec, parse_env

router = Router(tags=["jobs"])


class JobIn(Schema):
    """A job: ``args`` is the whole command, or the arguments of ``script`` (a file
    in your home run with the environment's python). Paths may be relative to your
    home (``train.py``, ``~/venv``)."""

    args: list[str] = []
    script: str = ""
    python: str = ""
    cwd: str = ""
    # {"NAME": "value"}, [["NAME", "value"], ...] or ["NAME=value", ...]; in order.
    env: dict[str, str] | list[tuple[str, str] | str] = []
    time_limit_minutes: int | None = None
    notify: bool = False
    use_tcmalloc: bool = True
    rerun_after_preemption: bool = False
    # A workdir snapshot of yours in the lab (``POST /labs/{slug}/snapshots``): its files
    # are put at ``cwd`` (relative: under your home; none: a folder of its own under
    # your home) on every worker before the command starts. Another person's snapshot,
    # or another lab's, is a 404.
    snapshot: int | None = None

    def spec(self) -> JobSpec:
        if isinstance(self.env, dict):
            env = list(self.env.items())
        else:
            env = []
            for item in self.env:
                env += parse_env(item) if isinstance(item, str) else [tuple(item)]
        return JobSpec(
            args=list(self.args),
            script=self.script,
            python=self.python,
            cwd=self.cwd,
            env=env,
            time_limit_minutes=self.time_limit_minutes,
            notify=self.notify,
            use_tcmalloc=self.use_tcmalloc,
            rerun_after_preemption=self.rerun_after_preemption,
            snapshot=self.snapshot,
        )


class JobError(Error):
    """A refused job: ``detail`` for people, and the messages per field of the input
    (``args``, ``script``, ``python``, ``cwd``, ``env``, ``time_limit_minutes``)."""

    errors: dict[str, list[str]] = {}


class JobSummaryOut(Schema):
    """A job as the VM's list shows it: anyone who may see the VM sees what waits and
    runs there. ``command`` is the whole command for your own jobs (and, for the lab's
    admins, everyone's); of another person's job only its program (``python3
    train.py``, without arguments), and ``command_complete`` is false. The environment
    and logs are in the job's own object."""

    id: int
    # The VM it runs on; null while a job submitted to a kind waits for one.
    vm_id: int | None
    vm: str | None
    # The kind a job submitted to the pool asked for ("" for a job named for its VM).
    accelerator_type: str
    zones: list[str]
    # any, on_demand or spot
    provisioning: str
    # When the pool gave it its VM.
    placed_at: datetime | None
    user: str
    username: str | None
    state: str
    reason: str
    command: str
    command_complete: bool
    queued_at: datetime
    begun_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    changed_at: datetime
    # Which run of the job this is (1, or one more than the run lost with its VM it
    # runs again). A job submitted to a kind and run again after its VM was lost:
    # that VM's name and what happened to it ("preempted", "under maintenance",
    # "deleted"); "" for any other job.
    attempt: int
    moved_from: str
    moved_why: str

    @staticmethod
    def resolve_vm(obj):
        return obj.vm.name if obj.vm_id else None

    @staticmethod
    def resolve_reason(obj, context):
        if obj.vm_id is None and obj.is_waiting:
            line = _pool_lines(context, obj.lab_id).get(obj.pk)
            return line.reason if line else obj.reason
        return obj.reason

    @staticmethod
    def resolve_user(obj):
        return obj.user.email

    @staticmethod
    def resolve_username(obj):
        account = getattr(obj.user, "unix_account", None)
        return account.username if account else None

    @staticmethod
    def resolve_command(obj, context):
        return obj.command_text if _sees_all_of(obj, context) else " ".join(obj.program)

    @staticmethod
    def resolve_command_complete(obj, context):
        return _sees_all_of(obj, context) or obj.program == obj.argv


def _pool_lines(context, lab_id: int) -> dict[int, scheduler.Line]:
    """Each of the lab's waiting pool jobs' place in line and why it waits, read once
    per lab and request."""
    request = context["request"]
    cache = request.__dict__.setdefault("_pool_lines", {})
    if lab_id not in cache:
        cache[lab_id] = scheduler.waiting_lines(lab_id)
    return cache[lab_id]


def _sees_all_of(job: Job, context) -> bool:
    """The owner and the lab's admins see a job's whole command; others who share the
    VM its program only. Whether the viewer administers the job's lab is asked once
    per lab and request."""
    request = context["request"]
    if job.user_id == request.user.pk:
        return True
    known = _admin_of_labs(request)
    lab_id = job.vm.lab_id if job.vm_id else job.lab_id
    if lab_id not in known:
        known[lab_id] = access.admin_labs(request.user).filter(pk=lab_id).exists()
    return known[lab_id]


def _admin_of_labs(request) -> dict[int, bool]:
    """Whether the viewer administers a lab, by lab id, as far as the request knows
    (an endpoint that has asked already says so here: no query more)."""
    return request.__dict__.setdefault("_job_lab_admin", {})


class JobPartOut(BaseModel):
    """One worker's part of a job. A plain pydantic model filled from the part by
    ``_parts_of`` in one pass (a pod's job has a part per worker, and its state is
    asked every few tenths of a second while it starts), not a field at a time."""

    index: int
    alias: str
    # pending, running, ended, lost, not_started
    state: str
    pid: int | None
    started_at: datetime | None
    ended_at: datetime | None
    exit_status: int | None
    signal: str
    outcome: str
    error: str
    # Bytes of the whole log on the worker, the last of it (at most
    # PORTAL_JOB_LOG_TAIL_BYTES), and where to download all of it (null where nothing
    # started, as on the workers of a job the pre-flight refused).
    log_size: int
    log_tail: str
    log_url: str | None


# A worker's host keys, which a job's parts do not show.
_WORKER_LISTS = ("worker__host_keys", "worker__published_host_keys")


def _parts_of(job: Job, request) -> list[dict]:
    """The job's parts as ``JobPartOut`` reads them, with the job and its VM as read
    already (reading them again per part would decode the job's pre-flight rows and
    the VM's lists once for each worker)."""
    out = []
    for part in job.parts.select_related("worker").defer(*_WORKER_LISTS):
        worker = part.worker
        if job.vm_id is not None and worker.vm_id == job.vm_id:
            worker.vm = job.vm
        log_url = None
        if part.has_log:
            path = f"/api/v1/labs/{job.vm.lab.slug}/vms/{job.vm_id}/jobs/{job.pk}"
            log_url = request.build_absolute_uri(f"{path}/workers/{part.index}/log")
        out.append({
            "index": part.index, "alias": worker.alias, "state": part.state,
            "pid": part.pid, "started_at": part.started_at, "ended_at": part.ended_at,
            "exit_status": part.exit_status, "signal": part.signal,
            "outcome": part.outcome, "error": part.error, "log_size": part.log_size,
            "log_tail": part.log_tail, "log_url": log_url,
        })  # fmt: skip
    return out


class PreflightCheckOut(BaseModel):
    """One check of the pre-flight on one worker: the same rows for a job that passed
    and for one it refused (``rejected``), where the failing ones say ``fail``. What the
    portal judges itself (versions against jax's pins, the script the same on every
    worker) fails the check it concerns; a worker that gave no answer has one row,
    ``preflight``, saying why (``it did not finish within 300 s``). A plain pydantic
    model: a pod's job has a dozen rows per worker."""

    worker: int
    check: str
    # ok, fail or note
    status: str
    detail: str


class JobSnapshotOut(Schema):
    """The workdir a job carries: its snapshot's id (null once it expired), the digest
    of its manifest, how many files and bytes, and until when it is kept."""

    id: int | None
    digest: str
    files: int | None
    bytes: int | None
    expires_at: datetime | None


class JobOut(JobSummaryOut):
    """A job with what it runs, where it stands and each worker's part (for the person
    who ran it and the lab's admins, who see all of it)."""

    # The slug of the VM's lab: with ``vm_id``, where the job's own paths are.
    lab: str
    host_id: str
    script: str
    args: list[str]
    python: str
    cwd: str
    env: list[list[str]]
    time_limit_minutes: int | None
    notify: bool
    rerun_after_preemption: bool
    use_tcmalloc: bool
    rerun_of: int | None
    # In words where a job run again after its VM was lost went ("tpu7 was
    # preempted; your job moved to tpu3."); "" for any other job.
    move: str
    cancel_requested_at: datetime | None
    # Once it has ended: 0 when it succeeded, else the exit status of the worker whose
    # process failed first (128 + N for one killed by signal N); null while it waits or
    # runs, and when no process failed (rejected, cancelled or lost before one did).
    exit_code: int | None
    # Its place in the VM's queue while it waits (1: next to start); for a job waiting
    # for a VM of its kind, in its kind's line.
    position: int | None
    preflight: list[PreflightCheckOut]
    parts: list[JobPartOut]
    url: str
    # The workdir it carries to the workers; null for a job without one.
    snapshot: JobSnapshotOut | None

    @staticmethod
    def resolve_snapshot(obj):
        if not obj.snapshot_digest:
            return None
        snapshot = obj.snapshot
        return {
            "id": obj.snapshot_id,
            "digest": obj.snapshot_digest,
            "files": snapshot.file_count if snapshot else None,
            "bytes": snapshot.total_bytes if snapshot else None,
            "expires_at": snapshot.expires_at if snapshot else None,
        }

    @staticmethod
    def resolve_command(obj):
        return obj.command_text

    @staticmethod
    def resolve_command_complete(obj):
        return True

    @staticmethod
    def resolve_lab(obj):
        return (obj.vm.lab if obj.vm_id else obj.lab).slug

    @staticmethod
    def resolve_reason(obj, context):
        if obj.vm_id is None and obj.is_waiting:
            line = _pool_lines(context, obj.lab_id).get(obj.pk)
            return line.reason if line else obj.reason
        return obj.reason

    @staticmethod
    def resolve_rerun_of(obj):
        return obj.rerun_of_id

    @staticmethod
    def resolve_move(obj):
        return obj.move_text

    @staticmethod
    def resolve_position(obj, context):
        if obj.vm_id is None and obj.is_waiting:
            # The pool's line goes by fair share, as placement serves it.
            line = _pool_lines(context, obj.lab_id).get(obj.pk)
            return line.place if line else None
        return usage.position(obj)

    @staticmethod
    def resolve_preflight(obj):
        return [
            {"worker": int(index), "check": c[0], "status": c[1], "detail": c[2]}
            for index, checks in sorted(obj.preflight.items(), key=lambda item: int(item[0]))
            for c in checks
        ]

    @staticmethod
    def resolve_parts(obj, context):
        return _parts_of(obj, context["request"])

    @staticmethod
    def resolve_url(obj, context):
        if obj.vm_id is None:
            path = reverse("lab_job", args=[obj.lab.slug, obj.pk])
        else:
            path = reverse("job_detail", args=[obj.vm.lab.slug, obj.vm_id, obj.pk])
        return context["request"].build_absolute_uri(path)


def _job_for(request, slug: str, vm_id: int, job_id: int) -> Job:
    lab = access.get_member_lab(request.user, slug)
    return access.get_job_for_viewer(request.user, lab, vm_id, job_id)


@router.post(
    "/labs/{slug}/vms/{vm_id}/jobs",
    response={201: JobOut, 400: JobError, 403: Error},
    summary="Queue a job on a TPU VM (people with active access to it)",
)
def submit_job(request, slug: str, vm_id: int, payload: JobIn):
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    try:
        job = job_services.submit_job(request.user, vm, payload.spec(), request=request)
    except ValidationError as exc:
        errors = exc.message_dict if hasattr(exc, "error_dict") else {}
        return Status(400, {"detail": " ".join(exc.messages), "errors": errors})
    return Status(201, _reloaded(job))


class JobCheckOut(Schema):
    """A job the portal would queue as it is now (nothing was stored)."""

    ok: bool
    detail: str


@router.post(
    "/labs/{slug}/vms/{vm_id}/jobs/validate",
    response={200: JobCheckOut, 400: JobError, 403: Error},
    summary="Check a job as queueing it would, and store nothing",
    description="The same body and the same refusals as queueing the job (400, 403), "
    "without queueing it: a client asks before it copies the job's files to the workers.",
)
def validate_job(request, slug: str, vm_id: int, payload: JobIn):
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    try:
        job_services.submit_job(request.user, vm, payload.spec(), dry_run=True)
    except ValidationError as exc:
        errors = exc.message_dict if hasattr(exc, "error_dict") else {}
        return Status(400, {"detail": " ".join(exc.messages), "errors": errors})
    return Status(200, {"ok": True, "detail": f"{vm.name} would queue this job."})


def _reloaded(job: Job) -> Job:
    return Job.objects.select_related("vm__lab", "lab", "user__unix_account", "snapshot").get(
        pk=job.pk
    )


@router.get(
    "/labs/{slug}/vms/{vm_id}/jobs",
    response=list[JobSummaryOut],
    summary="A TPU VM's jobs",
    description=PAGED + " The lab's admins see every job; others their own, and the jobs "
    "of others that wait for the VM or run on it.",
)
@paginate(KeysetPagination)
def list_jobs(
    request,
    slug: str,
    vm_id: int,
    state: str | None = Query(None, description=filter_help("state", JobState)),
    user: str | None = Query(None, description=filter_help("user")),
    updated_since: str | None = Query(None, description=filter_help("updated_since")),
):
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    jobs = Job.objects.filter(vm=vm).select_related("vm", "user__unix_account")
    is_admin = access.is_lab_admin(request.user, lab)
    _admin_of_labs(request)[lab.pk] = is_admin
    if not is_admin:
        jobs = jobs.filter(Q(user=request.user) | Q(state__in=[*WAITING_STATES, *ACTIVE_STATES]))
    state = parse_choice(state, JobState, "state")
    if state:
        jobs = jobs.filter(state=state)
    person = api_filters.lab_member(lab, user)
    if person is not None:
        jobs = jobs.filter(user=person)
    since = parse_since(updated_since)
    if since is not None:
        jobs = jobs.filter(changed_at__gte=since)
    return jobs


@router.get(
    "/labs/{slug}/vms/{vm_id}/jobs/{job_id}",
    response=JobOut,
    summary="One job, with each worker's part and the end of its log (its owner and "
    "the lab's admins)",
)
def get_job(request, slug: str, vm_id: int, job_id: int):
    return _job_for(request, slug, vm_id, job_id)


@router.get(
    "/me/jobs/{job_id}",
    response=JobOut,
    summary="One of my jobs, by its id alone (as its VM's path answers it)",
    description="The same object as `/labs/{slug}/vms/{vm_id}/jobs/{job_id}`, for a job "
    "you submitted: another person's job is a 404 here, even for the lab's admins, as is a "
    "job in a lab you are no longer in.",
)
def get_my_job(request, job_id: int):
    return access.get_own_job(request.user, job_id)


@router.post(
    "/labs/{slug}/vms/{vm_id}/jobs/{job_id}/cancel",
    response={200: JobOut, 409: Error},
    summary="Cancel a job (its owner and the lab's admins)",
)
def cancel_job(request, slug: str, vm_id: int, job_id: int):
    job = _job_for(request, slug, vm_id, job_id)
    if not access.may_cancel_job(request.user, job):
        raise PermissionDenied(access.CANCEL_REFUSED)
    if not job.can_cancel:
        return Status(409, {"detail": f"The job is {job.state}; there is nothing to cancel."})
    job_services.cancel_job(job, request.user, request=request)
    return Status(200, _reloaded(job))


@router.post(
    "/labs/{slug}/vms/{vm_id}/jobs/{job_id}/rerun",
    response={201: JobOut, 400: JobError, 403: Error, 409: Error},
    summary="Queue an ended job again (its owner)",
)
def rerun_job(request, slug: str, vm_id: int, job_id: int):
    job = _job_for(request, slug, vm_id, job_id)
    if job.user_id != request.user.pk:
        raise PermissionDenied("Only the person who submitted a job can run it again.")
    if not job.has_ended:
        return Status(409, {"detail": f"The job is {job.state}; only an ended job runs again."})
    try:
        new = job_services.rerun_job(request.user, job, request=request)
    except ValidationError as exc:
        errors = exc.message_dict if hasattr(exc, "error_dict") else {}
        return Status(400, {"detail": " ".join(exc.messages), "errors": errors})
    return Status(201, _reloaded(new))


@router.get(
    "/labs/{slug}/vms/{vm_id}/jobs/{job_id}/workers/{index}/log",
    response={404: Error, 502: Error},
    summary="One worker's whole log of a job (text/plain, read from the worker)",
)
def job_log(request, slug: str, vm_id: int, job_id: int, index: int):
    job = _job_for(request, slug, vm_id, job_id)
    part = job.parts.filter(index=index).first()
    if part is None:
        return Status(404, {"detail": f"Job {job.pk} has no part on worker {index}."})
    if not part.has_log:
        return Status(
            404, {"detail": f"Nothing of job {job.pk} started on worker {index}: it has no log."}
        )
    try:
        stream = job_logs.whole_log(job, index)
    except LookupError as exc:
        return Status(502, {"detail": f"The log cannot be read now: {exc}."})
    response = StreamingHttpResponse(stream, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{job_logs.filename(job, index)}"'
    return response


# --- usage -------------------------------------------------------------------------------


class HolderOut(Schema):
    """A process outside the portal that had a chip open at the last look."""

    worker: int
    device: str
    pid: str
    user: str
    command: str


class VmNowOut(Schema):
    vm_id: int
    vm: str
    zone: str
    # free, running (a job of the portal: ``job``) or held (outside the portal:
    # ``holders``, as of ``checked_at``)
    state: str
    job: JobSummaryOut | None
    holders: list[HolderOut]
    checked_at: datetime | None
    queue_length: int
    # Each chip's HBM and duty cycle as the job poll last read them.
    chips: ChipsOut


class PersonUsageOut(Schema):
    user: str
    username: str | None
    jobs: int
    worker_hours: float


class VmUsageOut(Schema):
    vm_id: int
    vm: str
    zone: str
    jobs: int
    worker_hours: float


class PeoplePageOut(Schema):
    """Worker-hours per person, one page (by the person's id)."""

    items: list[PersonUsageOut]
    next: str | None
    total: int


class VmsPageOut(Schema):
    """Worker-hours per TPU VM, one page (by the VM's id)."""

    items: list[VmUsageOut]
    next: str | None
    total: int


class NowPageOut(Schema):
    """What holds each TPU VM you may see, one page (by the VM's id)."""

    items: list[VmNowOut]
    next: str | None
    total: int


class UsageOut(Schema):
    """``from_date`` to ``to_date`` (UTC days, both included). ``definition`` says what
    a worker-hour is. Lab admins get everyone's rows; members only their own. Each of
    ``people``, ``vms`` and ``now`` is the first page of its list, whose ``next``
    continues at ``/usage/people``, ``/usage/vms`` or ``/usage/now``."""

    from_date: date
    to_date: date
    definition: str
    jobs: int
    worker_hours: float
    people: PeoplePageOut
    vms: VmsPageOut
    now: NowPageOut


def _day(raw: str | None, name: str) -> date | None:
    if raw is None or raw == "":
        return None
    try:
        return date.fromisoformat(raw.strip())
    except ValueError:
        raise HttpError(400, f"{name} must be a date such as 2025-06-01, not {raw!r}.") from None


class _UsageRequest:
    """What every usage endpoint reads first: the lab (a 404 outside your labs), who
    asks, the period, the page size and where to continue, refusing what it does
    not know."""

    def __init__(self, request, slug, *, from_date=None, to_date=None, limit=None, cursor=None,
                 known=("from", "to", "limit", "cursor")):  # fmt: skip
        self.request = request
        self.lab = access.get_member_lab(request.user, slug)  # another lab's: a 404 first
        refuse_unknown_parameters(request, set(known))
        self.is_admin = access.is_lab_admin(request.user, self.lab)
        _admin_of_labs(request)[self.lab.pk] = self.is_admin  # for the running jobs' rows
        default = usage.Period.last_days()
        first = _day(from_date, "from") or default.first
        last = _day(to_date, "to") or default.last
        if first > last:
            raise HttpError(400, "from must not be after to.")
        if (last - first).days + 1 > usage.MAX_DAYS:
            raise HttpError(400, f"A period is at most {usage.MAX_DAYS} days.")
        self.period = usage.Period(first, last)
        self.size = parse_limit(limit)
        self.after = decode_cursor(cursor)
        self.figures = usage.Usage(
            self.lab, self.period, user=None if self.is_admin else request.user
        )
        self.base = reverse("api:lab_usage", args=[self.lab.slug])

    def _page(self, items: list[dict], ids: list[int], path: str, total: int, drop=()) -> dict:
        more = len(items) > self.size
        after = ids[self.size - 1] if more else None
        return {
            "items": items[: self.size],
            "next": next_url(self.request, after, path=path, drop=drop) if more else None,
            "total": total,
        }

    def people(self, total: int) -> dict:
        grouped = self.figures.grouped("user", after=self.after, first=self.size + 1)
        rows = usage.name_people([{"id": k, "figures": f} for k, f in grouped.items()])
        items = [
            {
                "user": row["email"],
                "username": row["username"],
                "jobs": row["figures"].jobs,
                "worker_hours": usage.hours(row["figures"].total),
            }
            for row in rows
        ]
        return self._page(items, list(grouped), f"{self.base}/people", total)

    def vms(self, total: int) -> dict:
        grouped = self.figures.grouped("vm", after=self.after, first=self.size + 1)
        rows = usage.name_vms([{"id": k, "figures": f} for k, f in grouped.items()])
        items = [
            {
                "vm_id": row["id"],
                "vm": row["vm_name"],
                "zone": row["zone"],
                "jobs": row["figures"].jobs,
                "worker_hours": usage.hours(row["figures"].total),
            }
            for row in rows
        ]
        return self._page(items, list(grouped), f"{self.base}/vms", total)

    def now(self) -> dict:
        """As last seen: reading usage never asks a worker (``services.holders``)."""
        viewable = access.viewable_vms(self.request.user, self.lab, is_admin=self.is_admin)
        vms = usage.now_vms(viewable).order_by("pk")
        if self.after is not None:
            vms = vms.filter(pk__gt=self.after)
        now = usage.now_for(vms[: self.size + 1])
        means = chip_metrics.duty_means(n.vm.pk for n in now)
        items = [
            {
                "vm_id": n.vm.pk,
                "vm": n.vm.name,
                "zone": n.vm.zone,
                "state": n.state,
                "job": n.running,
                "holders": n.holders,
                "checked_at": n.vm.usage_checked_at,
                "queue_length": n.queue_length,
                "chips": chip_metrics.as_api(n.vm, n.running, means),
            }
            for n in now
        ]
        total = viewable.order_by().count()
        ids = [n.vm.pk for n in now]
        return self._page(items, ids, f"{self.base}/now", total, drop=("from", "to"))


_PERIOD_QUERY = {
    "from_date": Query(
        None, alias="from", description="First day, e.g. 2025-06-01; default 30 days ago."
    ),
    "to_date": Query(None, alias="to", description="Last day; default today."),
}
_LIMIT = "Rows per list: a whole number from 1 to the maximum (default as other lists)."
_CURSOR = "Where to continue: copy it from `next`, never build it."


@router.get(
    "/labs/{slug}/usage",
    response=UsageOut,
    url_name="lab_usage",
    summary="Worker-hours over a period, and the first page of each usage list",
    description="The period's totals, and the first `limit` rows of worker-hours per "
    "person, per TPU VM and of what holds each VM now, each as a page `{items, next, "
    "total}` whose `next` continues at `/usage/people`, `/usage/vms` or `/usage/now`. "
    "Reading usage never contacts a worker: `now` is as of each VM's `checked_at`.",
)
def lab_usage(
    request,
    slug: str,
    from_date: str | None = _PERIOD_QUERY["from_date"],
    to_date: str | None = _PERIOD_QUERY["to_date"],
    limit: str | None = Query(None, description=_LIMIT),
):
    asked = _UsageRequest(
        request, slug, from_date=from_date, to_date=to_date, limit=limit,
        known=("from", "to", "limit"),
    )  # fmt: skip
    summary = asked.figures.summary()
    return {
        "from_date": asked.period.first,
        "to_date": asked.period.last,
        "definition": usage.WORKER_HOURS,
        "jobs": summary["jobs"],
        "worker_hours": usage.hours(summary["total"]),
        "people": asked.people(summary["people"]),
        "vms": asked.vms(summary["vms"]),
        "now": asked.now(),
    }


@router.get(
    "/labs/{slug}/usage/people",
    response=PeoplePageOut,
    summary="Worker-hours per person over a period",
    description=PAGED + " Rows by the person's id. The lab's admins get everyone; members "
    "their own row.",
)
def lab_usage_people(
    request,
    slug: str,
    from_date: str | None = _PERIOD_QUERY["from_date"],
    to_date: str | None = _PERIOD_QUERY["to_date"],
    limit: str | None = Query(None, description=_LIMIT),
    cursor: str | None = Query(None, description=_CURSOR),
):
    asked = _UsageRequest(
        request, slug, from_date=from_date, to_date=to_date, limit=limit, cursor=cursor
    )
    return asked.people(asked.figures.summary()["people"])


@router.get(
    "/labs/{slug}/usage/vms",
    response=VmsPageOut,
    summary="Worker-hours per TPU VM over a period",
    description=PAGED + " Rows by the VM's id. Members' rows count their own jobs only.",
)
def lab_usage_vms(
    request,
    slug: str,
    from_date: str | None = _PERIOD_QUERY["from_date"],
    to_date: str | None = _PERIOD_QUERY["to_date"],
    limit: str | None = Query(None, description=_LIMIT),
    cursor: str | None = Query(None, description=_CURSOR),
):
    asked = _UsageRequest(
        request, slug, from_date=from_date, to_date=to_date, limit=limit, cursor=cursor
    )
    return asked.vms(asked.figures.summary()["vms"])


@router.get(
    "/labs/{slug}/usage/now",
    response=NowPageOut,
    summary="What holds each TPU VM you may see now",
    description=PAGED + " Rows by the VM's id: `free`, `running` (a job of the portal) "
    "or `held` (outside the portal, at the last look, `checked_at`). Reading this never "
    "contacts a worker.",
)
def lab_usage_now(
    request,
    slug: str,
    limit: str | None = Query(None, description=_LIMIT),
    cursor: str | None = Query(None, description=_CURSOR),
):
    asked = _UsageRequest(request, slug, limit=limit, cursor=cursor, known=("limit", "cursor"))
    return asked.now()

"""Who uses a lab's TPUs: what holds each VM now, its queue, and worker-hours over a
period. Read-only; every function answers in a fixed number of queries, whatever the
number of jobs (the sums are made by the database)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import (
    Case,
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from tpus import queue
from tpus.models import Job, Lab, TpuVm
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES
from tpus.services import job_engine

WORKER_HOURS = (
    "Worker-hours: for each job, the time it ran (from when it had started on every "
    "worker of the VM until it ended, or until now while it runs), counting only the part "
    "inside the period, times the number of workers it ran on. One hour of a job on a "
    "single-host TPU VM (v4-8) is 1 worker-hour; one hour on a v4-32 pod (4 workers) is 4."
)
DEFAULT_DAYS = 30
MAX_DAYS = 366
QUEUE_SHOWN = 50


# --- now -------------------------------------------------------------------------------


@dataclass
class VmNow:
    """What holds one VM's TPU now, and how many jobs wait for it."""

    vm: TpuVm
    running: Job | None
    queue_length: int

    @property
    def holders(self) -> list[dict]:
        """Processes outside the portal that held a chip at the last look (the
        pre-flight of the VM's last job), with ``vm.usage_checked_at``."""
        return self.vm.outside_holders or []

    @property
    def state(self) -> str:
        """``running`` (a portal job), ``held`` (something outside the portal, at the
        last look) or ``free``."""
        if self.running is not None:
            return "running"
        if self.holders:
            return "held"
        return "free"


def with_queue_length(vms: QuerySet) -> QuerySet:
    """``vms`` with ``queue_length``: their waiting jobs, counted in the same query."""
    waiting = (
        Job.objects.filter(vm=OuterRef("pk"), state__in=WAITING_STATES)
        .order_by()
        .values("vm")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return vms.annotate(queue_length=Coalesce(Subquery(waiting, output_field=IntegerField()), 0))


def now_for(vms) -> list[VmNow]:
    """What holds each of ``vms`` (annotated by ``with_queue_length``, or a list of
    them): one query for all their running jobs."""
    vms = list(vms)
    running = {
        job.vm_id: job
        for job in Job.objects.filter(
            vm__in=[vm.pk for vm in vms], state__in=ACTIVE_STATES
        ).select_related("vm", "user__unix_account")
    }
    return [VmNow(vm, running.get(vm.pk), getattr(vm, "queue_length", 0)) for vm in vms]


def vm_now(vm: TpuVm) -> tuple[VmNow, list[Job]]:
    """What holds ``vm``'s TPU now, and the first ``QUEUE_SHOWN`` jobs waiting for it
    in the order they will start: one query (and a count of the line only when it is
    longer than shown)."""
    jobs = list(
        Job.objects.filter(vm=vm, state__in=[*ACTIVE_STATES, *WAITING_STATES])
        .select_related("user__unix_account")
        .annotate(waiting=Case(When(state__in=ACTIVE_STATES, then=Value(0)), default=Value(1)))
        .order_by("waiting", "queued_at", "id")[: QUEUE_SHOWN + 1]
    )
    for job in jobs:
        job.vm = vm
    running = jobs[0] if jobs and not jobs[0].waiting else None
    line = [job for job in jobs if job.waiting][:QUEUE_SHOWN]
    if len(line) < QUEUE_SHOWN:
        waiting = len(line)
    else:
        waiting = Job.objects.filter(vm=vm, state__in=WAITING_STATES).count()
    return VmNow(vm, running, waiting), line


def look_again_where_stale(now: list[VmNow]) -> list[int]:
    """Queue a fresh look at who holds the chips of each VM whose last look is older
    than PORTAL_JOB_USAGE_REFRESH_SECONDS and that no job holds (its poll looks
    anyway). The page does not wait for it; no query. Returns the VMs' ids."""
    stale = [n.vm.pk for n in now if n.running is None and job_engine.usage_is_stale(n.vm)]
    stale = [vm_id for vm_id in stale if job_engine.claim_usage_look(vm_id)]
    for vm_id in stale:
        queue.check_tpu_usage(vm_id)
    return stale


def position(job: Job) -> int | None:
    """A waiting job's place in its VM's queue (1: next to start), else None."""
    if not job.is_waiting:
        return None
    ahead = (
        Job.objects.filter(vm_id=job.vm_id, state__in=WAITING_STATES)
        .filter(Q(queued_at__lt=job.queued_at) | Q(queued_at=job.queued_at, id__lt=job.pk))
        .count()
    )
    return ahead + 1


# --- over a period ---------------------------------------------------------------------


@dataclass(frozen=True)
class Period:
    """Whole days, ``first`` to ``last`` included, in the portal's time zone."""

    first: dt.date
    last: dt.date

    @classmethod
    def last_days(cls, days: int = DEFAULT_DAYS, today: dt.date | None = None) -> Period:
        today = today or timezone.localdate()
        return cls(today - dt.timedelta(days=days - 1), today)

    @property
    def start(self) -> dt.datetime:
        return _midnight(self.first)

    @property
    def end(self) -> dt.datetime:
        return _midnight(self.last + dt.timedelta(days=1))


def _midnight(day: dt.date) -> dt.datetime:
    return timezone.make_aware(dt.datetime.combine(day, dt.time()))


def jobs_in(lab: Lab, period: Period, *, user=None) -> QuerySet:
    """The lab's jobs that ran during ``period`` (of ``user`` alone when given), each
    annotated with ``worker_time``: its time inside the period times its workers."""
    now = timezone.now()
    jobs = Job.objects.filter(vm__lab=lab, started_at__isnull=False)
    if user is not None:
        jobs = jobs.filter(user=user)
    if period.start >= now:
        return jobs.none().annotate(worker_time=Value(dt.timedelta(), DurationField()))
    jobs = jobs.filter(started_at__lt=period.end).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gt=period.start)
    )
    began = Greatest(F("started_at"), Value(period.start, DateTimeField()))
    stopped = Least(
        Coalesce(F("ended_at"), Value(now, DateTimeField())), Value(period.end, DateTimeField())
    )
    return jobs.annotate(
        # (As IntegerField: SQLite multiplies a duration by that type only.)
        worker_time=ExpressionWrapper(
            (stopped - began) * ExpressionWrapper(F("worker_count"), IntegerField()),
            DurationField(),
        ),
    )


def by_person(jobs: QuerySet) -> QuerySet:
    """Rows of ``email``, ``username``, ``jobs``, ``worker_time``, most used first."""
    return (
        jobs.values("user")
        .annotate(
            email=F("user__email"),
            username=F("user__unix_account__username"),
            jobs=Count("pk"),
            total=Sum("worker_time"),
        )
        .order_by("-total", "email")
    )


def by_vm(jobs: QuerySet) -> QuerySet:
    """Rows of ``vm_name``, ``zone``, ``jobs``, ``total``, most used first."""
    return (
        jobs.values("vm")
        .annotate(
            vm_name=F("vm__name"), zone=F("vm__zone"), jobs=Count("pk"), total=Sum("worker_time")
        )
        .order_by("-total", "vm_name")
    )


def by_person_and_vm(jobs: QuerySet) -> QuerySet:
    """One row per person and VM, for the CSV."""
    return (
        jobs.values("user", "vm")
        .annotate(
            email=F("user__email"),
            username=F("user__unix_account__username"),
            vm_name=F("vm__name"),
            zone=F("vm__zone"),
            jobs=Count("pk"),
            total=Sum("worker_time"),
        )
        .order_by("email", "vm_name", "zone")
    )


def totals(jobs: QuerySet) -> dict:
    """``jobs`` and ``total`` over every job of ``jobs``."""
    row = jobs.order_by().aggregate(jobs=Count("pk"), total=Sum("worker_time"))
    return {"jobs": row["jobs"] or 0, "total": row["total"] or dt.timedelta()}


def hours(value: dt.timedelta | None) -> float:
    """Worker-hours to two decimals."""
    return round((value or dt.timedelta()).total_seconds() / 3600, 2)

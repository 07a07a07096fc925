"""Who uses a lab's TPUs: what holds each VM now, its queue, and worker-hours over a
period. Reading is read-only (it never asks a worker anything: see
``services.holders``) and answers in a fixed number of queries, whatever the number
of jobs; ``count_ended_jobs`` keeps the per-day rows the figures are summed from."""

from __future__ import annotations

import bisect
import datetime as dt
import functools
import hashlib
import itertools
import uuid
from dataclasses import dataclass, field

from django.core.cache import cache
from django.db import IntegrityError, transaction
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Greatest, Least, TruncDate
from django.utils import timezone

from accounts.models import User
from tpus.models import Job, Lab, TpuVm, UsageDay, Worker
from tpus.models.inventory import chip_count
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES
from tpus.services import fair_share

WORKER_HOURS = (
    "Worker-hours: for each job, the time it ran (from when it had started on every "
    "worker of the VM until it ended, or until now while it runs), counting only the part "
    "inside the period, times the number of workers it ran on. One hour of a job on a "
    "single-host TPU VM (v4-8) is 1 worker-hour; one hour on a v4-32 pod (4 workers) is 4."
)
DEFAULT_DAYS = 30
MAX_DAYS = 366
QUEUE_SHOWN = 50
# What is read of each job not in the per-day rows yet (``Usage._live``).
LIVE_FIELDS = (
    "user", "vm", "worker_time", "worker_count", "queued_at", "started_at", "ended_at",
    "vm__accelerator_type",
)  # fmt: skip


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


# What a "now" row reads of a VM and of its running job (a long list of them must not
# load every column and JSON field of each).
NOW_VM_FIELDS = (
    "id", "lab_id", "name", "zone", "outside_holders", "usage_checked_at",
    "chip_metrics", "chip_metrics_at",
)  # fmt: skip
NOW_JOB_FIELDS = (
    "id", "vm_id", "user_id", "state", "reason", "script", "args",
    "queued_at", "begun_at", "started_at", "ended_at", "changed_at",
    "user__email", "user__unix_account__username",
)  # fmt: skip


def now_vms(vms: QuerySet) -> QuerySet:
    """``vms`` as the "now" rows read them: the columns they show, and
    ``queue_length`` (``with_queue_length``)."""
    return with_queue_length(vms).only(*NOW_VM_FIELDS)


def now_for(vms) -> list[VmNow]:
    """What holds each of ``vms`` (from ``now_vms``, or a list of them): one query
    for all their running jobs, with the columns a row shows."""
    vms = list(vms)
    by_id = {vm.pk: vm for vm in vms}
    running = {}
    for job in (
        Job.objects.filter(vm__in=list(by_id), state__in=ACTIVE_STATES)
        .select_related("user__unix_account")
        .only(*NOW_JOB_FIELDS)
    ):
        job.vm = by_id[job.vm_id]
        running[job.vm_id] = job
    return [VmNow(vm, running.get(vm.pk), getattr(vm, "queue_length", 0)) for vm in vms]


def running_job(vm: TpuVm) -> Job | None:
    """The portal's job holding ``vm`` now, with its person's account (one query)."""
    return (
        Job.objects.filter(vm=vm, state__in=ACTIVE_STATES)
        .select_related("user__unix_account")
        .only(*NOW_JOB_FIELDS)
        .first()
    )


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


def position(job: Job) -> int | None:
    """A waiting job's place in its VM's queue (1: next to start), or in its kind's
    line while it waits for a VM of the pool, else None."""
    if not job.is_waiting:
        return None
    if job.vm_id is None:
        line = Job.objects.filter(
            lab_id=job.lab_id, vm__isnull=True, accelerator_type=job.accelerator_type
        )
    else:
        line = Job.objects.filter(vm_id=job.vm_id)
    ahead = (
        line.filter(state__in=WAITING_STATES)
        .filter(Q(queued_at__lt=job.queued_at) | Q(queued_at=job.queued_at, id__lt=job.pk))
        .count()
    )
    return ahead + 1


# --- over a period ---------------------------------------------------------------------
#
# A job's worker-time is kept per day, person and VM (``UsageDay``) once it has ended;
# a period sums its days' rows, and reads one by one only the jobs not in them yet
# (running, or ended since the last count: a few per VM at most). So the figures cost
# the same however many jobs the lab ran, and equal what summing every job of the
# period gives (tpus/tests/test_usage_days.py compares the two).


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


def worker_time(jobs: QuerySet, period: Period, now: dt.datetime) -> QuerySet:
    """``jobs`` that ran during ``period``, each annotated with ``worker_time``: its
    time inside the period (until ``now`` while it runs) times its workers."""
    jobs = jobs.filter(started_at__isnull=False)
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


class Figures:
    """Jobs and worker-time of one person, one VM or a whole period."""

    __slots__ = ("jobs", "total")

    def __init__(self, jobs: int = 0, total: dt.timedelta | None = None):
        self.jobs = jobs
        self.total = total or dt.timedelta()

    def add(self, jobs: int, total: dt.timedelta | None) -> None:
        self.jobs += jobs or 0
        self.total += total or dt.timedelta()


class Usage:
    """Worker-hours in ``lab`` over ``period`` (only ``user``'s when given), as of
    ``now``: the period's per-day rows summed per person or per VM in the database,
    which also sorts and pages them (each page's sums kept in the shared cache until
    more jobs are counted into the lab's rows), plus the jobs not in them yet (one
    query, made once per object: running, or ended since the last count, a few per VM
    at most). A page costs the same few queries however many people used the lab."""

    def __init__(self, lab: Lab, period: Period, *, user=None, now: dt.datetime | None = None):
        self.lab = lab
        self.period = period
        self.user = user
        self.now = now or timezone.now()

    def _days(self) -> QuerySet:
        days = UsageDay.objects.filter(
            lab=self.lab, day__range=(self.period.first, self.period.last)
        )
        if self.user is not None:
            days = days.filter(user=self.user)
        if self.period.start >= self.now:
            return days.none()
        return days

    def _sums(self, rows: QuerySet) -> QuerySet:
        return rows.annotate(
            started_n=Sum("started"),
            carried_n=Sum("carried", filter=Q(day=self.period.first)),
            total=Sum("worker_time"),
        )

    @staticmethod
    def _figures(row: dict) -> Figures:
        return Figures(row["started_n"] + (row["carried_n"] or 0), row["total"])

    def _cached(self, what: str, compute):
        """``compute()``, a reading of the period's per-day rows, from the shared cache
        while no jobs were counted into the lab's rows since (counting moves the lab's
        version on): a page's sums are read from the database once per change."""
        if self.period.start >= self.now:
            return compute()
        if "_version" not in self.__dict__:
            self.__dict__["_version"] = _version(self.lab.pk)
        name = ":".join(
            [
                "tpu-portal:usage",
                self.__dict__["_version"],
                str(self.lab.pk),
                self.period.first.isoformat(),
                self.period.last.isoformat(),
                str(self.user.pk if self.user is not None else "all"),
                what,
            ]
        )
        found = cache.get(name)
        if found is None:
            found = compute()
            cache.set(name, found, timeout=CACHED_SECONDS)
        return found

    def _sums_of(self, rows: QuerySet, key: str) -> list[dict]:
        return [
            {"id": row[key], "started_n": row["started_n"], "carried_n": row["carried_n"],
             "total": row["total"]}
            for row in rows
        ]  # fmt: skip

    @functools.cached_property
    def _live(self) -> list[dict]:
        """The period's jobs whose time is not in the per-day rows: ``user``, ``vm``,
        ``worker_time`` and the times of each (``LIVE_FIELDS``)."""
        jobs = Job.objects.filter(vm__lab=self.lab, usage_counted=False)
        if self.user is not None:
            jobs = jobs.filter(user=self.user)
        return list(worker_time(jobs, self.period, self.now).order_by().values(*LIVE_FIELDS))

    def _live_by(self, key: str) -> dict[int, Figures]:
        found: dict[int, Figures] = {}
        for row in self._live:
            found.setdefault(row[key], Figures()).add(1, row["worker_time"])
        return found

    def _with_live(self, key: str) -> tuple[dict[int, Figures], set[int]]:
        """Counted and live figures together of the ids (``key``: ``user`` or ``vm``)
        that have live jobs, and which of them have counted rows too: one query, for a
        few ids, made once per object."""
        made = self.__dict__.setdefault("_with_live_by", {})
        if key in made:
            return made[key]
        live = self._live_by(key)
        found: dict[int, Figures] = {}
        if live:
            ids = sorted(live)
            rows = self._cached(
                f"{key}:of:{_digest(ids)}",
                lambda: self._sums_of(
                    self._sums(self._days().filter(**{f"{key}__in": ids}).values(key)).order_by(),
                    key,
                ),
            )
            found = {row["id"]: self._figures(row) for row in rows}
        in_rows = set(found)
        for ident, figures in live.items():
            found.setdefault(ident, Figures()).add(figures.jobs, figures.total)
        made[key] = (found, in_rows)
        return made[key]

    def summary(self) -> dict:
        """``jobs`` and ``total`` of the period, and how many ``people`` and ``vms``
        used it: one aggregate over the per-day rows, and the few ids with live jobs
        (``_with_live``, which the pages read too)."""
        counted = self._cached(
            "summary",
            lambda: self._days().aggregate(
                started_n=Sum("started"),
                carried_n=Sum("carried", filter=Q(day=self.period.first)),
                total=Sum("worker_time"),
                people=Count("user", distinct=True),
                vms=Count("vm", distinct=True),
            ),
        )
        figures = Figures(
            (counted["started_n"] or 0) + (counted["carried_n"] or 0), counted["total"]
        )
        for row in self._live:
            figures.add(1, row["worker_time"])
        # Those with live jobs only, and no counted rows yet, are not in the count.
        people, in_rows = self._with_live("user")
        vms, vms_in_rows = self._with_live("vm")
        return {
            "jobs": figures.jobs,
            "total": figures.total,
            "people": counted["people"] + len(people.keys() - in_rows),
            "vms": counted["vms"] + len(vms.keys() - vms_in_rows),
        }

    def ranked(self, key: str, start: int, stop: int) -> list[dict]:
        """``{"id", "jobs", "total"}`` rows ``start`` to ``stop`` of the ids of ``key``
        (``user`` or ``vm``), the largest worker-time first (then the smaller id), as
        ranking everyone would give them. The database sums, sorts and slices the ids
        that have no live jobs; the few that have are ranked here and merged in. The
        database's slice begins as many rows before ``start`` as there are live ids,
        so wherever those fall, every row from ``start`` to ``stop`` is known."""
        if stop <= start:
            return []
        live = most_used_first(self._with_live(key)[0])
        first = max(0, start - len(live))
        others = sorted(r["id"] for r in live)
        rows = self._cached(
            f"{key}:ranked:{first}:{stop}:{_digest(others)}",
            lambda: self._sums_of(
                self._sums(self._days().exclude(**{f"{key}__in": others}).values(key)).order_by(
                    "-total", key
                )[first:stop],
                key,
            ),
        )
        counted = [
            {"id": row["id"], "jobs": f.jobs, "total": f.total}
            for row in rows
            for f in (self._figures(row),)
        ]
        if first == 0:
            merged, at = sorted(counted + live, key=_rank), 0
        elif not counted:
            return []  # ``start`` is past everyone: first >= the rows without live jobs
        else:
            # counted[0] stands at ``first`` among the rows without live jobs, so at
            # ``first`` plus the live rows before it; those before it are all before
            # ``start`` (first + len(live) <= start) and are left out.
            before = [r for r in live if _rank(r) < _rank(counted[0])]
            after = [r for r in live if _rank(r) >= _rank(counted[0])]
            merged = sorted(counted + after, key=_rank)
            at = first + len(before)
        return merged[start - at : stop - at]

    def grouped(self, key: str, *, after: int | None = None, first: int | None = None) -> dict:
        """Figures per ``key`` (``user`` or ``vm``) id, in id order: all of them, or
        the ``first`` ones after the id ``after`` (a keyset page, read as one)."""

        def read() -> list[dict]:
            counted = self._sums(self._days().values(key)).order_by(key)
            if after is not None:
                counted = counted.filter(**{f"{key}__gt": after})
            if first is not None:
                counted = counted[:first]
            return self._sums_of(counted, key)

        rows = self._cached(f"{key}:ids:{after}:{first}", read)
        found = {row["id"]: self._figures(row) for row in rows}
        last = max(found) if first is not None and len(found) == first else None
        for ident, figures in self._with_live(key)[0].items():
            if (after is None or ident > after) and (last is None or ident <= last):
                found[ident] = figures
        ids = sorted(found)
        if first is not None:
            ids = ids[:first]
        return {ident: found[ident] for ident in ids}

    def pairs(self) -> dict[tuple[int, int], Figures]:
        """Figures per (person, VM), for the CSV."""
        found: dict[tuple[int, int], Figures] = {}
        for row in self._sums(self._days().values("user", "vm")).order_by():
            found[(row["user"], row["vm"])] = self._figures(row)
        for live in self._live:
            found.setdefault((live["user"], live["vm"]), Figures()).add(1, live["worker_time"])
        return found

    # --- per day, for the charts (``services.usage_charts``) ---

    def per_day(self, key: str, ids, *, chips: bool = False) -> dict[dt.date, dict]:
        """Worker-time (or with ``chips`` chip-time: time × the VM's chips) on each day
        of the period that has any: of each of ``ids`` (``key``: ``user`` or ``vm``)
        that used it, and of everyone under ``None``. One query, a row per day for each
        of ``ids`` and one for the rest, kept in the cache like the other sums; plus the
        jobs not counted yet, each cut at midnights as counting would."""
        ids = sorted(ids)
        column = "chip_time" if chips else "worker_time"

        def read() -> list[tuple]:
            who = Case(When(**{f"{key}__in": ids}, then=F(key)), default=Value(None))
            rows = (
                self._days()
                .annotate(who=who)
                .values("day", "who")
                .annotate(time=Sum(column))
                .order_by()
            )
            return [(row["day"], row["who"], row["time"]) for row in rows]

        found: dict[dt.date, dict] = {}
        for day, who, time in self._cached(f"{key}:{column}:days:{_digest(ids)}", read):
            sums = found.setdefault(day, {None: dt.timedelta()})
            sums[None] += time
            if who is not None:
                sums[who] = time
        wanted = set(ids)
        for job in self._live:
            for day, time in self._live_days(job, chips=chips).items():
                sums = found.setdefault(day, {None: dt.timedelta()})
                sums[None] += time
                if job[key] in wanted:
                    sums[job[key]] = sums.get(job[key], dt.timedelta()) + time
        return found

    def _live_days(self, job: dict, *, chips: bool = False) -> dict[dt.date, dt.timedelta]:
        """A job not counted yet cut into the period's days (until now while it runs):
        its worker-time in each, or with ``chips`` its chip-time."""
        ended = job["ended_at"] or self.now  # as ``worker_time`` takes it
        times = chip_count(job["vm__accelerator_type"]) if chips else job["worker_count"]
        pieces = day_pieces(job["started_at"], ended, times)
        return {
            day: time
            for day, (_, _, time) in pieces.items()
            if self.period.first <= day <= self.period.last and time
        }

    def waits(self) -> dict[dt.date, Waits]:
        """How long the jobs that started on each day of the period waited, from being
        submitted until they ran on every worker (``Waits``). The counted jobs' counted
        per day in one query (kept in the cache until more are counted), the others
        from the jobs read one by one anyway."""

        def read() -> dict[dt.date, Waits]:
            jobs = Job.objects.filter(
                vm__lab=self.lab,
                usage_counted=True,
                started_at__gte=self.period.start,
                started_at__lt=self.period.end,
            )
            if self.user is not None:
                jobs = jobs.filter(user=self.user)
            edges = [dt.timedelta(seconds=edge) for edge in WAIT_EDGES]
            spans = [Q(wait__lt=edges[0])]
            spans += [Q(wait__gte=low, wait__lt=high) for low, high in itertools.pairwise(edges)]
            spans += [Q(wait__gte=edges[-1])]
            rows = (
                jobs.annotate(
                    day=TruncDate("started_at"),
                    wait=ExpressionWrapper(F("started_at") - F("queued_at"), DurationField()),
                )
                .values("day")
                .annotate(
                    longest=Max("wait"),
                    **{f"span_{n}": Count("pk", filter=span) for n, span in enumerate(spans)},
                )
                .order_by()
            )
            return {
                row["day"]: Waits(
                    [row[f"span_{n}"] for n in range(len(spans))],
                    max(round(row["longest"].total_seconds()), 0),
                )
                for row in rows
            }

        found = self._cached("waits", read) if self.period.start < self.now else {}
        for job in self._live:
            day = timezone.localtime(job["started_at"]).date()
            if self.period.first <= day <= self.period.last:
                waited = (job["started_at"] - job["queued_at"]).total_seconds()
                found.setdefault(day, Waits()).add(waited)
        return found


# How long jobs waited to start, in spans: under a minute, to ten minutes, to an hour,
# to six hours, and longer (seconds).
WAIT_EDGES = (60, 600, 3600, 6 * 3600)


@dataclass
class Waits:
    """The jobs that started on one day: how many waited within each span of
    ``WAIT_EDGES`` (``counts``), and the longest wait in seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_EDGES) + 1))
    longest: int = 0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_right(WAIT_EDGES, seconds)] += 1
        self.longest = max(self.longest, round(seconds))


def worker_counts(vm_ids) -> dict[int, int]:
    """How many workers each of ``vm_ids`` has: one query."""
    return dict(
        Worker.objects.filter(vm_id__in=list(vm_ids))
        .order_by()
        .values("vm")
        .annotate(n=Count("pk"))
        .values_list("vm", "n")
    )


def _rank(row: dict) -> tuple:
    return (-row["total"], row["id"])


def _digest(ids: list[int]) -> str:
    """A short name for a set of ids, for a cache key."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


class MostUsedFirst:
    """The people (``key="user"``) or VMs (``"vm"``) of a period, most used first, as
    a sequence a Paginator can page (each page read as one from the database);
    ``count`` is known beforehand (``summary``)."""

    def __init__(self, figures: Usage, key: str, count: int):
        self.figures = figures
        self.key = key
        self._count = count

    def count(self) -> int:
        return self._count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, part: slice) -> list[dict]:
        start, stop, _ = part.indices(self._count)
        return self.figures.ranked(self.key, start, stop)


def most_used_first(grouped: dict[int, Figures]) -> list[dict]:
    """``{"id", "jobs", "total"}`` rows, the largest worker-time first."""
    rows = [{"id": ident, "jobs": f.jobs, "total": f.total} for ident, f in grouped.items()]
    rows.sort(key=_rank)
    return rows


def name_people(rows: list[dict]) -> list[dict]:
    """``rows`` (with ``id``: a user's) with ``email`` and ``username``: one query."""
    names = {
        row["pk"]: row
        for row in User.objects.filter(pk__in=[r["id"] for r in rows]).values(
            "pk", "email", username=F("unix_account__username")
        )
    }
    for row in rows:
        row["email"], row["username"] = names[row["id"]]["email"], names[row["id"]]["username"]
    return rows


def name_vms(rows: list[dict]) -> list[dict]:
    """``rows`` (with ``id``: a VM's) with ``vm_name`` and ``zone``: one query."""
    names = {
        row["pk"]: row
        for row in TpuVm.objects.filter(pk__in=[r["id"] for r in rows]).values("pk", "name", "zone")
    }
    for row in rows:
        row["vm_name"], row["zone"] = names[row["id"]]["name"], names[row["id"]]["zone"]
    return rows


def hours(value: dt.timedelta | None) -> float:
    """Worker-hours to two decimals."""
    return round((value or dt.timedelta()).total_seconds() / 3600, 2)


# --- keeping the per-day rows ----------------------------------------------------------

# How long a period's figures stay in the cache (a newer version replaces them sooner).
CACHED_SECONDS = 3600


def _version(lab_id: int) -> str:
    """The lab's figures' version: a new one whenever jobs are counted into its rows."""
    key = f"tpu-portal:usage-version:{lab_id}"
    version = cache.get(key)
    if version is None:
        cache.add(key, uuid.uuid4().hex, timeout=None)
        version = cache.get(key) or "none"
    return version


def _new_versions(lab_ids) -> None:
    for lab_id in lab_ids:
        cache.set(f"tpu-portal:usage-version:{lab_id}", uuid.uuid4().hex, timeout=None)


COUNT_BATCH = 500


class _Raced(Exception):
    """Another process counted some of the same jobs meanwhile."""


def count_ended_jobs(limit: int = COUNT_BATCH) -> int:
    """Add up to ``limit`` ended jobs not counted yet to the per-day rows and to their
    people's recent use (``fair_share``), and mark them counted, in one transaction;
    returns how many. A job whose end is not after its start (never seen) stays read
    one by one, as it always counts the same."""
    try:
        with transaction.atomic():
            jobs = list(
                Job.objects.select_for_update(skip_locked=True, of=("self",))
                .filter(started_at__isnull=False, usage_counted=False, ended_at__gt=F("started_at"))
                .annotate(vm_lab_id=F("vm__lab_id"), vm_accelerator_type=F("vm__accelerator_type"))
                .only("pk", "user_id", "vm_id", "started_at", "ended_at", "worker_count")
                .order_by("pk")[:limit]
            )
            if not jobs:
                return 0
            ids = [job.pk for job in jobs]
            if Job.objects.filter(pk__in=ids, usage_counted=False).update(
                usage_counted=True
            ) != len(ids):
                raise _Raced
            _add_to_days(jobs)
            # The same jobs, once, in their people's recent use (the pool's fair share).
            fair_share.count_ended(jobs, timezone.now())
            # Now for this transaction's own reads, and again once it commits, so that
            # figures cached meanwhile from the rows before it are not kept.
            labs = {job.vm_lab_id for job in jobs}
            _new_versions(labs)
            transaction.on_commit(lambda: _new_versions(labs))
    except (_Raced, IntegrityError):
        return 0
    return len(jobs)


def count_all_ended_jobs() -> int:
    """Every ended job not counted yet (``manage.py count_usage``)."""
    total = 0
    while counted := count_ended_jobs():
        total += counted
    return total


def recount_all() -> int:
    """The per-day rows (and everyone's recent use) made again from every job: after
    TIME_ZONE changed (a day is a day in the portal's time zone)."""
    with transaction.atomic():
        labs = set(UsageDay.objects.values_list("lab_id", flat=True).distinct())
        UsageDay.objects.all().delete()
        fair_share.forget_use()
        Job.objects.filter(usage_counted=True).update(usage_counted=False)
        _new_versions(labs)
        transaction.on_commit(lambda: _new_versions(labs))
    return count_all_ended_jobs()


def day_pieces(started: dt.datetime, ended: dt.datetime, workers: int) -> dict:
    """``{day: (started, carried, worker_time)}`` of one ended job: 1 on the day it
    started, 1 on each later day it was running at midnight, and its time inside each
    day times its workers (or times its chips, for its chip-time)."""
    pieces = {}
    day = timezone.localtime(started).date()
    first = day
    last = timezone.localtime(ended).date()
    while day <= last:
        begin, end = _midnight(day), _midnight(day + dt.timedelta(days=1))
        inside = min(ended, end) - max(started, begin)
        carried = int(started < begin < ended)
        if day == first or carried:
            pieces[day] = (int(day == first), carried, max(inside, dt.timedelta()) * workers)
        day += dt.timedelta(days=1)
    return pieces


def _add_to_days(jobs: list[Job]) -> None:
    """Add the jobs' day pieces to their rows: one query to read (and lock) the rows
    that exist, one to update them, one to make the others."""
    sums: dict[tuple, list] = {}
    for job in jobs:
        # Chip-time as ``fair_share`` counts the job: its time × its VM's chips.
        chip_pieces = day_pieces(job.started_at, job.ended_at, chip_count(job.vm_accelerator_type))
        for day, (started, carried, time) in day_pieces(
            job.started_at, job.ended_at, job.worker_count
        ).items():
            key = (job.vm_lab_id, day, job.user_id, job.vm_id)
            row = sums.setdefault(key, [0, 0, dt.timedelta(), dt.timedelta()])
            row[0] += started
            row[1] += carried
            row[2] += time
            row[3] += chip_pieces[day][2]
    existing = {
        (row.lab_id, row.day, row.user_id, row.vm_id): row
        for row in UsageDay.objects.select_for_update().filter(
            lab_id__in={key[0] for key in sums},
            day__in={key[1] for key in sums},
            user_id__in={key[2] for key in sums},
            vm_id__in={key[3] for key in sums},
        )
    }
    changed, made = [], []
    for key, (started, carried, time, chip_time) in sums.items():
        row = existing.get(key)
        if row is None:
            lab_id, day, user_id, vm_id = key
            made.append(UsageDay(lab_id=lab_id, day=day, user_id=user_id, vm_id=vm_id,
                                 started=started, carried=carried, worker_time=time,
                                 chip_time=chip_time))  # fmt: skip
        else:
            row.started += started
            row.carried += carried
            row.worker_time += time
            row.chip_time += chip_time
            changed.append(row)
    UsageDay.objects.bulk_update(
        changed, ["started", "carried", "worker_time", "chip_time"], batch_size=500
    )
    # Two runs making the same new row at once: the second's unique constraint fails,
    # its transaction rolls back whole, and the next poll counts its jobs again.
    UsageDay.objects.bulk_create(made, batch_size=500)

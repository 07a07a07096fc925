"""Each chip's runtime metrics (HBM used of total, TensorCore duty cycle), live.

libtpu serves them over gRPC on the worker's local ports in TPU_RUNTIME_METRICS_PORTS,
which the portal sets for every job (``ports``). The job poll asks for them in the
``job-status.sh`` exec it makes on each worker anyway (no SSH session of its own), and
hands what each worker answered to ``record``: the VM keeps the last answer per worker
(``TpuVm.chip_metrics``, for the VM's page, the API and ``tpu ls``), and ``ChipSample``
a short history per chip, pruned past PORTAL_CHIP_METRICS_KEEP_MINUTES in the same
pass (a fixed number of queries per poll, whatever the number of workers and chips).
A VM's workers are asked at most about once per PORTAL_CHIP_METRICS_EVERY_SECONDS
(``ports_to_ask``): the polls in between cost what they did before.

Each reading is also folded into the VM's row of its day (``VmDutyDay``, kept like the
usage rows), so the usage page can chart how busy the chips were over any period long
after the samples are gone (``duty_days``): one more query per reading.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Avg, DateField, F, FloatField, Func, IntegerField, Sum, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from tpus.models import ChipSample, TpuVm, VmDutyDay
from tpus.remote import WorkerOutcome
from tpus.remote.jobs import WorkerMetrics, parse_status

GIB = 1024**3
# Why a worker has no metrics when it did not answer the poll at all.
NO_ANSWER = "the worker did not answer"


def ports() -> tuple[int, ...]:
    """Where every job's libtpu serves its metrics, and where the poll reads them."""
    return tuple(int(p) for p in settings.PORTAL_CHIP_METRICS_PORTS)


def _interval() -> dt.timedelta:
    """PORTAL_CHIP_METRICS_EVERY_SECONDS less half a job poll, so that the poll on the
    beat that follows the interval reads again."""
    every = settings.PORTAL_CHIP_METRICS_EVERY_SECONDS - settings.PORTAL_JOB_POLL_SECONDS / 2
    return dt.timedelta(seconds=max(0.0, every))


def _kept() -> dt.timedelta:
    return dt.timedelta(minutes=settings.PORTAL_CHIP_METRICS_KEEP_MINUTES)


def ports_to_ask(vm: TpuVm, *, now=None) -> tuple[int, ...]:
    """The ports this poll of ``vm`` asks for metrics: none when the last read is
    younger than the interval."""
    wanted = ports()
    last = vm.chip_metrics_at
    if not wanted or last is None:
        return wanted
    return wanted if (now or timezone.now()) - last >= _interval() else ()


def answers(workers, outcomes: list[WorkerOutcome]) -> dict[int, WorkerMetrics | None]:
    """Each worker's metrics (by index) from its job-status.sh answer; None for one
    that did not answer, or whose answer does not read (the job poll says why)."""
    found: dict[int, WorkerMetrics | None] = {}
    for worker, outcome in zip(workers, outcomes, strict=True):
        found[worker.index] = None
        if outcome.ok:
            try:
                metrics = parse_status(outcome.result.pairs).metrics
            except ValueError:
                continue
            found[worker.index] = metrics or WorkerMetrics(none="not reported")
    return found


def record(vm: TpuVm, answers: Mapping[int, WorkerMetrics | None], *, now=None) -> None:
    """Keep what each worker (by index) answered: the last answer on the VM, a sample
    per chip unless the VM's last sample is younger than the interval (so a chip has
    at most the window over the interval of them), and the samples past the window
    removed. ``None``: the worker did not answer."""
    if not answers or not ports():
        return
    now = now or timezone.now()
    latest = []
    for index in sorted(answers):
        answer = answers[index]
        if answer is None:
            latest.append({"worker": index, "chips": [], "none": NO_ANSWER})
            continue
        chips = [
            {"chip": c.chip, "used": c.hbm_used, "total": c.hbm_total, "duty": c.duty}
            for c in answer.chips
        ]
        latest.append({"worker": index, "chips": chips, "none": answer.none})
    before = vm.chip_metrics_at
    # The reading follows ``before`` only if no other was stored meanwhile; otherwise
    # its interval is not known, and it is not folded into the day rows.
    follows = TpuVm.objects.filter(pk=vm.pk, chip_metrics_at=before).update(
        chip_metrics=latest, chip_metrics_at=now
    )
    if not follows:
        TpuVm.objects.filter(pk=vm.pk).update(chip_metrics=latest, chip_metrics_at=now)
    vm.chip_metrics, vm.chip_metrics_at = latest, now
    if follows and before is not None:
        _fold(vm, before, now, latest)
    samples = [
        ChipSample(vm=vm, worker=row["worker"], chip=c["chip"], at=now, hbm_used=c["used"],
                   hbm_total=c["total"], duty=c["duty"])
        for row in latest
        for c in row["chips"]
    ]  # fmt: skip
    ChipSample.objects.filter(vm=vm, at__lt=now - _kept()).delete()
    if samples and not ChipSample.objects.filter(vm=vm, at__gt=now - _interval()).exists():
        ChipSample.objects.bulk_create(samples)


def _cap() -> dt.timedelta:
    """The longest interval a reading stands for: twice the time between readings
    (the interval, or the job poll when that is slower). A longer gap is not counted
    as observed beyond it."""
    every = max(settings.PORTAL_CHIP_METRICS_EVERY_SECONDS, settings.PORTAL_JOB_POLL_SECONDS)
    return dt.timedelta(seconds=2 * every)


def day_seconds(begin: dt.datetime, end: dt.datetime) -> dict[dt.date, float]:
    """The seconds of ``begin`` to ``end`` on each day of the portal's time zone."""
    found: dict[dt.date, float] = {}
    while begin < end:
        day = timezone.localtime(begin).date()
        midnight = timezone.make_aware(dt.datetime.combine(day + dt.timedelta(days=1), dt.time()))
        stop = min(midnight, end)
        found[day] = found.get(day, 0.0) + (stop - begin).total_seconds()
        begin = stop
    return found


def _fold(vm: TpuVm, before: dt.datetime, now: dt.datetime, latest: list[dict]) -> None:
    """Add the reading at ``now`` (the one before at ``before``) to the VM's day rows:
    the time since ``before`` up to the cap, as observed, at the mean duty cycle of the
    chips read. A reading without chips adds nothing. One UPDATE per day (two across a
    midnight), and an INSERT for a day's first reading."""
    chips = [c for row in latest for c in row["chips"]]
    if not chips:
        return
    duty = sum(float(c["duty"]) for c in chips) / len(chips) / 100
    peak = max((c["used"] / c["total"] for c in chips if c["total"]), default=0.0)
    for day, seconds in day_seconds(max(before, now - _cap()), now).items():
        added = {
            "observed": F("observed") + seconds,
            "duty": F("duty") + seconds * duty,
            "hbm_peak": Greatest(F("hbm_peak"), Value(peak, FloatField())),
        }
        if VmDutyDay.objects.filter(vm=vm, day=day).update(**added):
            continue
        try:
            with transaction.atomic():
                VmDutyDay.objects.create(
                    vm=vm, day=day, observed=seconds, duty=seconds * duty, hbm_peak=peak
                )
        except IntegrityError:  # made by another reading meanwhile
            VmDutyDay.objects.filter(vm=vm, day=day).update(**added)


@dataclass(frozen=True)
class DutyDay:
    """One VM's day: seconds observed, and those seconds times the chips' mean duty
    cycle (``busy``; ``busy / observed`` is the day's mean, 0 to 1)."""

    observed: float
    busy: float


class _WeekOf(Func):
    """Which week from ``first`` a date is in (0: its first seven days), as a number:
    cheaper for the database and to build than a CASE with a branch per week."""

    output_field = IntegerField()
    template = "((%(expressions)s) / 7)"
    arg_joiner = " - "

    def __init__(self, day, first: dt.date):
        super().__init__(day, Value(first, DateField()))

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(
            compiler, connection, arg_joiner=") - julianday(",
            template="(CAST(julianday(%(expressions)s) AS INTEGER) / 7)", **extra
        )  # fmt: skip


def duty_days(lab, vm_ids, bars) -> dict[int, dict[dt.date, DutyDay]]:
    """The day rows of ``lab``'s VMs of ``vm_ids`` over ``bars`` (``portal.charts.Bin``:
    a day each, or a week from the first day) that have any time observed, summed per
    VM and bar in the database, by VM id and the bar's first day: one query, a row per
    VM and bar."""
    if not bars:
        return {}
    first = bars[0].first
    rows = VmDutyDay.objects.filter(
        vm__lab=lab, vm_id__in=list(vm_ids), day__range=(first, bars[-1].last), observed__gt=0
    )
    weekly = any(b.first != b.last for b in bars)
    rows = rows.annotate(bar=_WeekOf(F("day"), first) if weekly else F("day"))
    found: dict[int, dict[dt.date, DutyDay]] = {}
    summed = rows.values("vm_id", "bar").annotate(o=Sum("observed"), d=Sum("duty")).order_by()
    for vm_id, bar, observed, busy in summed.values_list("vm_id", "bar", "o", "d"):
        day = first + dt.timedelta(days=7 * bar) if weekly else bar
        found.setdefault(vm_id, {})[day] = DutyDay(observed, busy)
    return found


# --- what the page, the API and the client show ---------------------------------------


@dataclass(frozen=True)
class ChipNow:
    """One chip as last read, and who holds it."""

    worker: int
    chip: int
    hbm_used: int
    hbm_total: int
    duty: float
    holder: str  # the portal job's person, a process outside the portal, or ""
    duty_mean: float | None = None  # over the kept samples; None without any

    @property
    def used_gib(self) -> float:
        return self.hbm_used / GIB

    @property
    def total_gib(self) -> float:
        return self.hbm_total / GIB

    @property
    def used_percent(self) -> float:
        return 100 * self.hbm_used / self.hbm_total if self.hbm_total else 0.0


@dataclass(frozen=True)
class WorkerNow:
    """One worker's chips as last read, or why it has none."""

    worker: int
    chips: list[ChipNow]
    none: str


def duty_means(vm_ids) -> dict[tuple[int, int, int], float]:
    """Each chip's mean duty cycle over its kept samples, by (VM id, worker, chip), for
    any number of VMs in one query."""
    rows = (
        ChipSample.objects.filter(vm_id__in=list(vm_ids), at__gte=timezone.now() - _kept())
        .values("vm_id", "worker", "chip")
        .annotate(duty=Avg("duty"))
        .order_by()
    )
    return {(r["vm_id"], r["worker"], r["chip"]): r["duty"] for r in rows}


def workers_now(vm: TpuVm, running=None, means=None) -> list[WorkerNow]:
    """The VM's last answer per worker, each chip with who holds it: ``running`` (the
    portal's job on the VM, its person's user loaded) holds every chip; otherwise a
    process outside the portal that had the chip's device open at the last look.
    ``means``: from ``duty_means``. No query: the VM's own fields."""
    job_holder = ""
    if running is not None:
        account = getattr(running.user, "unix_account", None)
        job_holder = f"job {running.pk} of {account.username if account else running.user.email}"
    outside: dict[tuple[int, int], str] = {}
    for h in vm.outside_holders or []:
        number = re.search(r"([0-9]+)$", str(h.get("device", "")))
        if number:
            outside.setdefault(
                (int(h.get("worker", -1)), int(number[1])), f"{h.get('user')} (pid {h.get('pid')})"
            )
    rows = []
    for row in vm.chip_metrics or []:
        index = int(row["worker"])
        chips = [
            ChipNow(index, int(c["chip"]), int(c["used"]), int(c["total"]), float(c["duty"]),
                    job_holder or outside.get((index, int(c["chip"])), ""),
                    (means or {}).get((vm.pk, index, int(c["chip"]))))
            for c in row.get("chips", [])
        ]  # fmt: skip
        rows.append(WorkerNow(index, chips, row.get("none", "")))
    return rows


def as_api(vm: TpuVm, running=None, means=None) -> dict:
    """The API's ``chips``: when last read, the whole VM's figures, and each worker's
    chips (or why it has none)."""
    workers = workers_now(vm, running, means)
    return {
        "read_at": vm.chip_metrics_at,
        "summary": summary(workers),
        "workers": [
            {
                "worker": w.worker,
                "none": w.none,
                "chips": [
                    {
                        "chip": c.chip,
                        "hbm_used_bytes": c.hbm_used,
                        "hbm_total_bytes": c.hbm_total,
                        "duty_cycle_percent": c.duty,
                        "duty_cycle_percent_mean": c.duty_mean,
                        "holder": c.holder,
                    }
                    for c in w.chips
                ],  # fmt: skip
            }
            for w in workers
        ],
    }


def summary(workers: list[WorkerNow]) -> dict | None:
    """HBM used and total over every chip read, the mean duty cycle and the number of
    chips; None when no chip was read."""
    chips = [c for w in workers for c in w.chips]
    if not chips:
        return None
    return {
        "chips": len(chips),
        "hbm_used_bytes": sum(c.hbm_used for c in chips),
        "hbm_total_bytes": sum(c.hbm_total for c in chips),
        "duty_cycle_percent": round(sum(c.duty for c in chips) / len(chips), 1),
    }


def history(vm: TpuVm) -> dict[tuple[int, int], list[ChipSample]]:
    """The kept samples of each chip of ``vm``, by (worker, chip), oldest first."""
    found: dict[tuple[int, int], list[ChipSample]] = {}
    for sample in ChipSample.objects.filter(vm=vm).order_by("worker", "chip", "at"):
        found.setdefault((sample.worker, sample.chip), []).append(sample)
    return found

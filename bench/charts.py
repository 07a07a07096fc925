"""The lab's usage page with and without its charts, side by side in one run.

Builds the lab of ``bench.pages`` (5,000 people, 500 TPU VMs with about 4,000 workers,
5,000 jobs over the last 30 days) on a throw-away PostgreSQL database, adds as many
jobs again that waited in the queue (seconds to hours) so the chart of waits has
something to draw, counts them all into the per-day usage rows, gives every VM a row
of its chips' duty cycle for each day of the last year (as the job poll folds its
readings in), and then, in this
process with Django's test client on PostgreSQL with Redis as the cache, times the
usage page as the lab's admin and as a member, for the last 30 days and for a year
(a week a bar): each sample once with the charts and once without (the page's view
with ``usage_charts.for_usage`` returning none), alternately, so both see the same
machine. "Cold" deletes the lab's usage version first (every sum is read from the
database again, as after jobs were counted); "warm" reads the sums from the cache.
Then the charts alone, part by part: reading their series, drawing them (shapes and
tables), writing the SVG, and their template.

    .venv/bin/python -m bench.charts                # full scale, ~2 min
    .venv/bin/python -m bench.charts --scale 0.05   # a quick check
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import time

from bench.common import Stack, machine, table


def add_waiting_jobs(lab: dict, count: int) -> float:
    """``count`` ended jobs over the last 30 days that each waited in the queue first
    (an exponential spread, 30 minutes on average, at most 12 hours), by people with
    access on the VMs they may use; then counted into the per-day rows. Returns the
    seconds the count took."""
    from django.utils import timezone

    from tpus.models import Grant, Job, TpuVm
    from tpus.services import usage

    rng = random.Random(16)
    pairs = list(
        Grant.objects.filter(vm__lab=lab["lab"], state="active").values_list("user_id", "vm_id")
    )
    workers = {
        vm.pk: 32 if vm.accelerator_type == "v4-256" else 1
        for vm in TpuVm.objects.filter(lab=lab["lab"])
    }
    now = timezone.now()
    jobs = []
    for i in range(count):
        user_id, vm_id = pairs[rng.randrange(len(pairs))]
        ended = now - dt.timedelta(seconds=rng.uniform(60, 30 * 86400))
        started = ended - dt.timedelta(seconds=rng.uniform(600, 4 * 3600))
        waited = dt.timedelta(seconds=min(rng.expovariate(1 / 1800), 12 * 3600))
        jobs.append(Job(user_id=user_id, vm_id=vm_id, host_id=f"bench-wait-{i}",
                        state="succeeded", args=["python3", "train.py"],
                        queued_at=started - waited, begun_at=started - dt.timedelta(seconds=20),
                        started_at=started, ended_at=ended, changed_at=ended,
                        worker_count=workers[vm_id]))  # fmt: skip
    Job.objects.bulk_create(jobs, batch_size=5000)
    began = time.monotonic()
    usage.count_all_ended_jobs()
    return time.monotonic() - began


def add_duty_days(lab: dict, days: int = 366) -> int:
    """A duty-cycle row per VM of the lab and day of the last ``days``, then ANALYZE;
    returns how many."""
    from django.db import connection
    from django.utils import timezone

    from tpus.models import TpuVm, VmDutyDay

    rng = random.Random(17)
    today = timezone.localdate()
    rows = []
    for vm_id in TpuVm.objects.filter(lab=lab["lab"]).values_list("pk", flat=True):
        for n in range(days):
            seen = rng.uniform(60, 86400)
            rows.append(VmDutyDay(vm_id=vm_id, day=today - dt.timedelta(days=n), observed=seen,
                                  duty=seen * rng.random(), hbm_peak=rng.random()))  # fmt: skip
    VmDutyDay.objects.bulk_create(rows, batch_size=5000)
    # The planner's statistics of a table that grew over months (autovacuum keeps them).
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return len(rows)


def measure(lab: dict, reps: int) -> list[list]:
    from django.core.cache import cache
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from tpus.services import usage_charts

    real = usage_charts.for_usage
    today = timezone.localdate()
    year = f"?from={today - dt.timedelta(days=365):%Y-%m-%d}&to={today:%Y-%m-%d}"
    path = f"/labs/{lab['lab'].slug}/usage/"
    version = f"tpu-portal:usage-version:{lab['lab'].pk}"
    clients = {}
    for who in ("admin", "member"):
        clients[who] = Client()
        clients[who].force_login(lab[who])

    def get(who: str, url: str, charts: bool, cold: bool) -> tuple[float, int, int]:
        usage_charts.for_usage = real if charts else (lambda *a, **k: [])
        if cold:
            cache.delete(version)
        try:
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                response = clients[who].get(url)
                elapsed = time.perf_counter() - started
        finally:
            usage_charts.for_usage = real
        assert response.status_code == 200, (url, response.status_code)
        return elapsed * 1000, len(queries), len(response.content)

    rows = []
    for who, name, url in (
        ("admin", "30 days, admin", path),
        ("member", "30 days, member", path),
        ("admin", "a year, admin", path + year),
    ):
        found = {}
        for cold in (True, False):
            get(who, url, True, cold)  # warm-up: templates, the first sums
            samples = {True: [], False: []}
            for _ in range(reps):
                for charts in (True, False):
                    samples[charts].append(get(who, url, charts, cold))
            found[cold] = samples
        row = [name]
        for cold in (True, False):
            with_ms = statistics.median(s[0] for s in found[cold][True])
            without_ms = statistics.median(s[0] for s in found[cold][False])
            row += [round(with_ms, 1), round(without_ms, 1), round(with_ms - without_ms, 1),
                    round(with_ms / without_ms, 2)]  # fmt: skip
        warm = found[False]
        row += [f"{warm[True][0][1]} / {warm[False][0][1]}",
                f"{found[True][True][0][1]} / {found[True][False][0][1]}",
                f"{warm[True][0][2]} / {warm[False][0][2]}"]  # fmt: skip
        rows.append(row)
    return rows


def charts_alone(lab: dict, reps: int) -> list[list]:
    """The charts' parts, as the lab's admin sees them: reading their series
    (``read_series``: queries, or the cache), drawing them (``draw``: the shapes and
    tables), writing the SVG, and the template of the charts with their tables; and
    the CPU time of this thread over all four (what the load of others does not add)."""
    from django.core.cache import cache
    from django.template.loader import render_to_string
    from django.utils import timezone

    from tpus.services import usage, usage_charts

    rows = []
    today = timezone.localdate()
    for name, period in (
        ("30 days", usage.Period.last_days()),
        ("a year", usage.Period(today - dt.timedelta(days=365), today)),
    ):
        for cold in (True, False):
            times: dict[str, list[float]] = {"read": [], "draw": [], "svg": [], "html": []}
            cpu: list[float] = []
            for _ in range(reps + 1):
                if cold:
                    cache.delete(f"tpu-portal:usage-version:{lab['lab'].pk}")
                figures = usage.Usage(lab["lab"], period)
                vms = usage.name_vms(figures.ranked("vm", 0, 50))
                figures.summary()  # what the page reads before the charts
                began, cpu_began = time.perf_counter(), time.thread_time()
                series = usage_charts.read_series(figures, vms, everyone=True)
                read = time.perf_counter()
                charts = usage_charts.draw(series)
                drawn = time.perf_counter()
                svgs = [str(c.svg) for c in charts]
                written = time.perf_counter()
                html = render_to_string("tpus/_usage_charts.html", {"charts": charts})
                done = time.perf_counter()
                cpu.append((time.thread_time() - cpu_began) * 1000)
                for part, (a, b) in {
                    "read": (began, read),
                    "draw": (read, drawn),
                    "svg": (drawn, written),
                    "html": (written, done),
                }.items():
                    times[part].append((b - a) * 1000)  # fmt: skip
            med = {part: statistics.median(t[1:]) for part, t in times.items()}
            rows.append([name, "cold" if cold else "warm", round(med["read"], 1),
                         round(med["draw"], 2), round(med["svg"], 2), round(med["html"], 1),
                         round(sum(med.values()), 1), round(statistics.median(cpu[1:]), 1),
                         sum(len(c.rects) for c in charts),
                         sum(len(s) for s in svgs), len(html)])  # fmt: skip
    return rows


def main() -> None:
    from bench.pages import build_lab

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="lab size (1: full)")
    parser.add_argument("--reps", type=int, default=9, help="samples per cell (medians)")
    args = parser.parse_args()

    stack = Stack("charts")
    try:
        stack.setup_django()
        lab = build_lab(args.scale)
        more = int(5000 * args.scale)
        seconds = add_waiting_jobs(lab, more)
        duty_rows = add_duty_days(lab)
        from tpus.models import Job

        print(
            f"Added {more} jobs that waited in the queue (counted in {seconds:.1f} s): "
            f"{Job.objects.filter(vm__lab=lab['lab']).count()} jobs in the lab; "
            f"{duty_rows} rows of duty cycle per VM and day.\n"
        )
        print(f"{machine()}\n")
        print(
            f"The usage page in this process (Django test client, PostgreSQL, Redis cache), "
            f"median of {args.reps} per cell, with and without charts alternately:\n"
        )
        print(
            table(
                [
                    "page",
                    "cold ms with",
                    "cold ms without",
                    "cold charts ms",
                    "cold ratio",
                    "warm ms with",
                    "warm ms without",
                    "warm charts ms",
                    "warm ratio",
                    "queries warm (with / without)",
                    "queries cold",
                    "bytes",
                ],
                measure(lab, args.reps),
            )  # fmt: skip
        )
        print(
            "\nThe charts alone (the lab's admin; after the page's own reads): reading the "
            "series, drawing them, writing the SVG, the template with the tables:\n"
        )
        print(
            table(
                [
                    "period",
                    "sums",
                    "read ms",
                    "draw ms",
                    "svg ms",
                    "template ms",
                    "total ms",
                    "total cpu ms",
                    "rectangles",
                    "svg bytes",
                    "html bytes",
                ],  # fmt: skip
                charts_alone(lab, args.reps),
            )
        )
        print(f"\nAfterwards: {machine()}")
    finally:
        stack.close()


if __name__ == "__main__":
    main()

"""Fair share over time: two people with equal shares share a pool of four v4-8, one
of them with 100 chip-hours of recent use; 40 equal jobs each, all submitted at once
(the heavy user's first).

    .venv/bin/python -m bench.fairness
    .venv/bin/python -m bench.fairness --hours 2 --half-life-days 1

Time is simulated: each job runs a fixed time; whenever VMs free, the ended jobs are
added to their people's recent use as usage's count adds them
(``fair_share.count_ended``'s arithmetic: the row decayed to now, plus each job's
decayed chip-hours), a snapshot is made as ``scheduler.load`` makes it (decayed use
plus the running jobs' use so far, chips held, grants), and the scheduler's real
``decide`` picks the jobs for the free VMs. Beside it, the same run served first come,
first served (``scheduler.fifo``), and the fair-share model's expectation: the light
user has the whole pool until their decayed use reaches the heavy user's, then each
has half (a fluid model, in job starts). No database and no hosts: the decision and
the arithmetic are pure.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
from pathlib import Path

from bench.common import machine, table

ROOT = Path(__file__).resolve().parent.parent
VMS, JOBS, CHIPS, HEAVY_USE = 4, 40, 4, 100.0
HEAVY, LIGHT = 1, 2
START = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.test")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def simulate(order_key, job_hours: float, half: dt.timedelta) -> list[dict]:
    """Each decision's time, who started what, and both people's recent use then."""
    from tpus.services import fair_share, scheduler

    length = dt.timedelta(hours=job_hours)
    vms = [
        scheduler.VmRow(n, f"tpu{n}", "v4-8", "us-central2-b", False, True, CHIPS)
        for n in range(VMS)
    ]
    # Submitted at once, the heavy user's 40 first: first come, first served would
    # give them the pool.
    waiting = [
        scheduler.JobRow(seq, person, "v4-8", (), "any", seq)
        for seq, person in enumerate([HEAVY] * JOBS + [LIGHT] * JOBS)
    ]
    grants = {(person, vm.id) for person in (HEAVY, LIGHT) for vm in vms}
    # The fair-share rows: (use, decayed_at) per person.
    rows = {HEAVY: (HEAVY_USE, START), LIGHT: (0.0, START)}
    running: dict[int, tuple[int, dt.datetime]] = {}  # vm id -> (person, started)
    now, steps = START, []
    while waiting or running:
        # The jobs that ended by now: counted into their people's rows, their VMs free.
        for vm_id, (person, started) in list(running.items()):
            if started + length <= now:
                use, at = rows[person]
                added = fair_share.job_use(CHIPS, started, started + length, now, half)
                rows[person] = (fair_share.decay(use, at, now, half) + added, now)
                del running[vm_id]
        for vm in vms:
            vm.free = vm.id not in running
        use = {}
        for person, (stored, at) in rows.items():
            use[person] = fair_share.decay(stored, at, now, half) + sum(
                fair_share.job_use(CHIPS, started, None, now, half)
                for who, started in running.values()
                if who == person
            )
        held = {p: CHIPS * sum(1 for who, _ in running.values() if who == p) for p in rows}
        snapshot = scheduler.Snapshot(
            1, 0, vms, list(waiting), grants, held, use, {HEAVY: 1.0, LIGHT: 1.0}
        )
        placed = scheduler.decide(snapshot, order_key=order_key)
        by_id = {job.id: job for job in waiting}
        started_now = {HEAVY: 0, LIGHT: 0}
        for placement in placed:
            job = by_id[placement.job_id]
            running[placement.vm_id] = (job.user_id, now)
            started_now[job.user_id] += 1
            waiting.remove(job)
        steps.append({"at": now, "started": started_now, "use": use})
        if not running:
            break
        now = min(started + length for _, started in running.values())
    return steps


def catch_up_hours(half: dt.timedelta) -> float:
    """When the light user's decayed use, having had the whole pool, reaches the
    heavy user's decaying 100 chip-hours (the model's switch from all to half)."""
    rate = VMS * CHIPS  # chip-hours per hour
    h = half / dt.timedelta(hours=1)

    def gap(t: float) -> float:
        light = rate * h / math.log(2) * (1 - 2 ** (-t / h))
        return light - HEAVY_USE * 2 ** (-t / h)

    low, high = 0.0, 10_000.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    return high


def model_starts(hours: float, job_hours: float, switch: float) -> tuple[float, float]:
    """The model's cumulative job starts (light, heavy) up to and including ``hours``:
    VM-hours handed out by then over the job length."""
    handed = hours + job_hours  # the starts at ``hours`` hand out VM-time until then
    light = VMS * min(handed, switch) + VMS / 2 * max(0.0, handed - switch)
    heavy = VMS / 2 * max(0.0, handed - switch)
    light, heavy = light / job_hours, heavy / job_hours
    # Nobody starts more jobs than they have.
    if light > JOBS:
        heavy += light - JOBS
        light = JOBS
    return min(light, JOBS), min(heavy, JOBS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=1.0, help="each job's length")
    parser.add_argument("--half-life-days", type=float, default=7.0)
    args = parser.parse_args(argv)
    setup_django()
    from tpus.services import scheduler

    half = dt.timedelta(days=args.half_life_days)
    fair = simulate(scheduler.fair_share_order, args.hours, half)
    fifo = simulate(scheduler.fifo, args.hours, half)
    switch = catch_up_hours(half)
    rows, totals, fifo_totals = [], {HEAVY: 0, LIGHT: 0}, {HEAVY: 0, LIGHT: 0}
    for step, first in zip(fair, fifo, strict=False):
        for person in (HEAVY, LIGHT):
            totals[person] += step["started"][person]
            fifo_totals[person] += first["started"][person]
        hours = (step["at"] - START) / dt.timedelta(hours=1)
        model_light, model_heavy = model_starts(hours, args.hours, switch)
        rows.append([
            f"{hours:g}",
            f"{step['started'][LIGHT]}–{step['started'][HEAVY]}",
            f"{totals[LIGHT]} / {totals[HEAVY]}",
            f"{model_light:.1f} / {model_heavy:.1f}",
            f"{fifo_totals[LIGHT]} / {fifo_totals[HEAVY]}",
            f"{step['use'][LIGHT]:.1f} / {step['use'][HEAVY]:.1f}",
        ])  # fmt: skip
    print("## Fair share: two people, equal shares, a pool of 4 v4-8\n")
    print(f"{machine()}.\n")
    print(
        f"`.venv/bin/python -m bench.fairness --hours {args.hours:g} --half-life-days "
        f"{args.half_life_days:g}`: {JOBS} jobs each of {args.hours:g} h on {CHIPS} chips, "
        f"all submitted at hour 0 (the heavy user's first); the heavy user starts with "
        f"{HEAVY_USE:g} chip-hours of recent use, the light one with none; half-life "
        f"{args.half_life_days:g} days. Light / heavy in each column.\n"
    )
    print(
        table(
            [
                "hour",
                "started now (light–heavy)",
                "started so far",
                "model's expectation so far",
                "first come, first served so far",
                "recent use then (chip-hours)",
            ],
            rows,
        )
    )
    light_alone = next(
        (
            (s["at"] - START) / dt.timedelta(hours=1)
            for s in fair
            if s["started"][HEAVY] > 0
        ),
        float("nan"),
    )  # fmt: skip
    print(
        f"\nThe model gives the light user the whole pool until hour {switch:.2f} (their "
        f"decayed use reaches the heavy user's), then half each. The scheduler gave the "
        f"heavy user their first VM at hour {light_alone:g}; all {2 * JOBS} jobs had "
        f"started by hour {(fair[-1]['at'] - START) / dt.timedelta(hours=1):g}."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The pool's placement decision with 500 VMs, 50 kinds and 2,000 waiting jobs.

    .venv/bin/python -m bench.placement              # 21 repetitions
    .venv/bin/python -m bench.placement --reps 51

A lab of rows only (nothing on hosts, no Celery process): 500 READY VMs of 50
accelerator types (10 of each), 100 people with an active grant on every VM of ten
kinds each, one running job on nine VMs in ten (one of each kind is
free), an ended job not yet counted into usage on every VM, a fair-share row (share
and recent use) for every person, and 2,000 jobs waiting for a kind (40 per kind, in
order of submission), served by fair share. Measured in this process on
PostgreSQL, with the queries counted by CaptureQueriesContext:

- the decision: ``scheduler.load`` (the snapshot) and ``scheduler.decide``, as
  placement runs them, and ``decide`` alone;
- all of ``scheduler.place`` (the lab's row lock, the snapshot, the decision, the
  conditional UPDATE and the read back), rolled back after each repetition so every
  one places the same jobs;
- ``scheduler.reasons`` (why each job waits), which the pool's list and pages read.
"""

from __future__ import annotations

import argparse
import time

from bench.common import Stack, machine, median, table

VMS, KINDS, JOBS, PEOPLE = 500, 50, 2000, 100


def build():
    from accounts.models import UnixAccount, User
    from tpus.models import FairShare, Grant, Job, Lab, TpuVm

    lab = Lab.objects.create(name="Pool Lab", slug="pool", gcp_project_id="pool-lab-1")
    kinds = [f"v{2 + k % 5}-{8 * (1 + k // 5)}" for k in range(KINDS)]
    people = User.objects.bulk_create(User(email=f"p{n}@pool.example") for n in range(PEOPLE))
    UnixAccount.objects.bulk_create(
        UnixAccount(user=u, username=f"p{n}", uid=60000 + n) for n, u in enumerate(people)
    )
    vms = TpuVm.objects.bulk_create(
        TpuVm(
            lab=lab,
            name=f"tpu{n}",
            zone="us-central2-b",
            accelerator_type=kinds[n % KINDS],
            state="READY",
            source="manual",
            preemptible=n % 2 == 0,
        )
        for n in range(VMS)
    )
    # Each person may use every VM of ten kinds (those k with k % 5 == n % 5).
    grants = [
        Grant(user=u, vm=vm, state="active")
        for n, u in enumerate(people)
        for index, vm in enumerate(vms)
        if index % KINDS % 5 == n % 5
    ]
    Grant.objects.bulk_create(grants)
    running = [
        Job(vm=vm, lab=lab, user=people[n % PEOPLE], host_id=f"r{n}", state="running", args=["x"])
        for n, vm in enumerate(vms)
        if (n // KINDS) % 10  # the first VM of each kind is free
    ]
    Job.objects.bulk_create(running)
    # What fair share reads besides the rows: the ended jobs usage has not counted yet.
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    ended = [
        Job(vm=vm, lab=lab, user=people[(n + 1) % PEOPLE], host_id=f"e{n}", state="succeeded",
            args=["x"], started_at=now - timedelta(hours=2), ended_at=now - timedelta(hours=1),
            worker_count=1)
        for n, vm in enumerate(vms)
    ]  # fmt: skip
    Job.objects.bulk_create(ended)
    FairShare.objects.bulk_create(
        FairShare(lab=lab, user=u, use=float(n * 7 % 300), share=1 + n % 3)
        for n, u in enumerate(people)
    )
    waiting = [
        Job(
            lab=lab,
            user=people[n % PEOPLE],
            accelerator_type=kinds[n % KINDS],
            host_id=f"w{n}",
            args=["x"],
        )
        for n in range(JOBS)
    ]
    Job.objects.bulk_create(waiting)
    # The planner's statistics, as autovacuum keeps them on a lab that grew slowly.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return lab, len(grants)


def timed(function, reps: int):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    times, queries, result = [], [], None
    for _ in range(reps):
        with CaptureQueriesContext(connection) as captured:
            began = time.perf_counter()
            result = function()
            times.append((time.perf_counter() - began) * 1000)
        queries.append(len(captured))
    return median(times), min(times), max(queries), result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    args = parser.parse_args(argv)
    stack = Stack("placement")
    try:
        stack.setup_django()
        from django.db import transaction

        from tpus.services import scheduler

        lab, grants = build()
        snapshot = scheduler.load(lab.pk)
        free = sum(vm.free for vm in snapshot.vms)

        class Undo(Exception):
            pass

        def place_and_undo():
            try:
                with transaction.atomic():
                    placed = scheduler.place(lab.pk)
                    raise Undo(placed)
            except Undo as undo:
                return undo.args[0]

        rows = []
        for label, function in [
            ("decision: snapshot + decide", lambda: scheduler.decide(scheduler.load(lab.pk))),
            ("decide alone (no database)", lambda: scheduler.decide(snapshot)),
            ("place (lock, decide, UPDATE, read back)", place_and_undo),
            ("why each job waits (reasons)", lambda: scheduler.why_they_wait(lab.pk)),
        ]:
            mid, best, queries, result = timed(function, args.reps)
            rows.append([label, f"{mid:.1f}", f"{best:.1f}", queries, len(result)])
        print(f"## Placement: {VMS} VMs, {KINDS} kinds, {JOBS} waiting jobs\n")
        print(f"{machine()}; PostgreSQL; {args.reps} repetitions; {PEOPLE} people, {grants} "
              f"active grants, {free} free VMs.\n")  # fmt: skip
        print(table(["what", "median ms", "best ms", "queries", "placed / answered"], rows))
        target = float(rows[0][1]) <= 20
        print(f"\nTarget: the decision ≤ 20 ms with a constant number of queries: "
              f"{'met' if target else 'NOT met'}.")  # fmt: skip
    finally:
        stack.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

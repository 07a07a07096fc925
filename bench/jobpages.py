"""Part 5 of ``bench.jobs``: the queries of the job pages with 100 and with 50,000 jobs.

A lab of rows only (nothing on hosts, no Celery process running): an admin, 20 members
with access to two VMs of 4 and 32 workers, and jobs with one part per worker, ended
over the last 28 days (nine in ten on the 4-worker VM), plus one running and four
queued per VM. Each page is fetched with Django's test client in this process and its
queries counted with CaptureQueriesContext, first with the small count of jobs, then
with the large one. A page whose URL name does not resolve is skipped and named.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta

from bench.common import table

ZONE = "us-central2-b"
# (label, URL name, who, which VM)
PAGES = [
    ("VM page, 32 workers", "vm_detail", "admin", "big"),
    ("VM page (member)", "vm_detail", "member", "small"),
    ("VM jobs page, 32 workers", "vm_jobs", "admin", "big"),
    ("VM jobs page (member)", "vm_jobs", "member", "small"),
    ("lab usage (admin)", "lab_usage", "admin", None),
    ("lab usage (member)", "lab_usage", "member", None),
]
# Indexes of the running and queued jobs, apart from the ended ones.
LIVE = 10_000_000
OUTCOMES = ["succeeded"] * 14 + ["failed"] * 3 + ["cancelled"] * 2 + ["lost"]


def query_counts(small: int, large: int, tag: str) -> list[str]:
    """The part's printed lines: a table of queries per page at both sizes."""
    from django.urls import NoReverseMatch, reverse

    lab = usage_lab()
    pages, skipped = [], []
    for label, url_name, who, vm in PAGES:
        kwargs = {"slug": lab["lab"].slug}
        if vm:
            kwargs["vm_id"] = lab[vm].pk
        try:
            pages.append((label, who, reverse(url_name, kwargs=kwargs)))
        except NoReverseMatch:
            skipped.append(f"{label}: the URL name '{url_name}' does not resolve here")
    add_jobs(lab, 0, small, tag, live=True)
    before = count_queries(lab, pages)
    began = time.monotonic()
    add_jobs(lab, small, large - small, tag, live=False)
    built = time.monotonic() - began
    after = count_queries(lab, pages)
    rows = [
        [label, who, before[label][0], after[label][0],
         "yes" if before[label][0] == after[label][0] else "NO",
         before[label][1], after[label][1], f"{before[label][2]}, {after[label][2]}"]
        for label, who, _ in pages
    ]  # fmt: skip
    lines = [
        f"5. queries per page with {small:,} and with {large:,} jobs in one lab (rows only; "
        f"the other {large - small:,} and their parts added in {built:.1f} s, then ANALYZE; "
        "Django's test client, CaptureQueriesContext; ms of one request, noisy)",
    ]
    if rows:
        headers = ["page", "as", f"queries @{small}", f"queries @{large}", "same",
                   f"ms @{small}", f"ms @{large}", "HTTP"]  # fmt: skip
        lines.append(table(headers, rows))
    lines += [
        f"skipped: {s} (the page is built elsewhere; rerun once it is merged)" for s in skipped
    ]
    return lines


def usage_lab() -> dict:
    """The lab: its workers have documentation addresses (192.0.2.0/24) that nothing
    contacts, since no Celery process runs during this part."""
    from django.utils import timezone

    from accounts.models import UnixAccount, User
    from tpus.models import Grant, Lab, Membership, TpuVm, Worker

    now = timezone.now()
    lab = Lab.objects.create(
        name="Usage Lab", slug="usage", gcp_project_id="bench-usage", zones=[ZONE]
    )
    users = User.objects.bulk_create(
        [User(email=f"usage{i}@jobs.example", full_name=f"Usage {i}") for i in range(21)]
    )
    UnixAccount.objects.bulk_create(
        [UnixAccount(user=u, username=f"use{i}", uid=90_000 + i) for i, u in enumerate(users)]
    )
    Membership.objects.bulk_create(
        [Membership(lab=lab, user=u, role="admin" if i == 0 else "member", state="approved",
                    policy_version_accepted=lab.policy_version, policy_accepted_at=now)
         for i, u in enumerate(users)]
    )  # fmt: skip
    small, big = TpuVm.objects.bulk_create(
        [TpuVm(lab=lab, name=f"usage{n}", zone=ZONE, accelerator_type=f"v4-{8 * n}",
               state="READY", health="HEALTHY", source="imported") for n in (4, 32)]
    )  # fmt: skip
    Worker.objects.bulk_create(
        [Worker(vm=vm, index=w, internal_ip=f"192.0.2.{w + 1}", external_ip=f"192.0.2.{w + 1}")
         for vm, n in ((small, 4), (big, 32)) for w in range(n)]
    )  # fmt: skip
    Grant.objects.bulk_create(
        [Grant(user=u, vm=vm, state="active") for u in users[1:] for vm in (small, big)]
    )
    return {"lab": lab, "admin": users[0], "member": users[1], "members": users[1:],
            "small": small, "big": big}  # fmt: skip


def add_jobs(lab: dict, first: int, count: int, tag: str, *, live: bool) -> None:
    """``count`` ended jobs with their parts, numbered from ``first``; with ``live``,
    one running and four queued per VM too. Then the ended ones are counted into the
    per-day usage rows (as the job poll does when they end) and ANALYZE runs, as
    autovacuum would have."""
    from django.db import connection
    from django.utils import timezone

    from tpus.models import Job
    from tpus.services import usage

    now = timezone.now()
    members = lab["members"]
    workers = {vm.pk: list(vm.workers.order_by("index")) for vm in (lab["small"], lab["big"])}
    rng = random.Random(first)

    def job(i: int, vm, state: str, **times) -> Job:
        home = f"/home/use{(i % len(members)) + 1}"
        return Job(vm=vm, user=members[i % len(members)], host_id=f"use-{i}-{tag}", state=state,
                   script=f"{home}/train.py", args=["--step", str(i)], python=f"{home}/venv",
                   reason="" if state == "succeeded" else "Worker 0 (w0) exit 1.",
                   **times)  # fmt: skip

    for start in range(first, first + count, 5000):
        jobs = []
        for i in range(start, min(first + count, start + 5000)):
            vm = lab["big"] if i % 10 == 0 else lab["small"]
            ended = now - timedelta(seconds=rng.uniform(60, 28 * 86400))
            started = ended - timedelta(seconds=rng.uniform(30, 4 * 3600))
            queued = started - timedelta(seconds=rng.uniform(1, 600))
            jobs.append(job(i, vm, rng.choice(OUTCOMES), queued_at=queued, begun_at=queued,
                            started_at=started, ended_at=ended, changed_at=ended))  # fmt: skip
        _with_parts(jobs, workers)
    if live:
        jobs = []
        hour_ago = now - timedelta(hours=1)
        for n, vm in enumerate((lab["small"], lab["big"])):
            times = {"queued_at": hour_ago, "begun_at": hour_ago, "started_at": hour_ago}
            jobs.append(job(LIVE + n, vm, "running", changed_at=now, **times))
            jobs += [
                job(LIVE + 10 + 10 * n + q, vm, "queued", queued_at=now - timedelta(minutes=30 - q))
                for q in range(4)
            ]
        _with_parts(jobs, workers)
    usage.count_all_ended_jobs()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def _with_parts(jobs, workers) -> None:
    from tpus.models import Job, JobWorker

    parts = []
    for job in jobs:
        if job.state != "queued":
            job.worker_count = len(workers[job.vm_id])
    for job in Job.objects.bulk_create(jobs):
        if job.state == "queued":
            continue
        live = job.state == "running"
        for w in workers[job.vm_id]:
            parts.append(JobWorker(
                job=job, worker=w, index=w.index, state="running" if live else "ended",
                pid=2000 + w.index, started_at=job.started_at, ended_at=job.ended_at,
                exit_status=None if live else int(job.state != "succeeded"),
                log_offset=120, log_size=120, log_tail="step 100 loss 0.25\n" * 6,
            ))  # fmt: skip
    JobWorker.objects.bulk_create(parts, batch_size=10000)


def count_queries(lab: dict, pages) -> dict[str, tuple]:
    """(queries or ``HTTP <status>``, ms, status) per page label."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    clients = {}
    for who in ("admin", "member"):
        clients[who] = Client()
        clients[who].force_login(lab[who])
    counts = {}
    for label, who, path in pages:
        clients[who].get(path)  # a first visit may make the lab's key pair
        with CaptureQueriesContext(connection) as context:
            began = time.perf_counter()
            status = clients[who].get(path).status_code
            ms = (time.perf_counter() - began) * 1000
        counts[label] = (len(context) if status == 200 else f"HTTP {status}", ms, status)
    return counts

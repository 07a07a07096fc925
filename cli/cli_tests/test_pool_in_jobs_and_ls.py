"""`tpu jobs` and `tpu ls` against the live portal show the pool: each waiting pool
job's place in its kind's line and why it waits, a placed one's VM, and for a job run
again after its VM was lost, its run and where it came from and why; `tpu ls` a line
per kind the person's jobs wait for, and both keep every field in `--json`."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.utils import timezone

from accounts.services import create_token
from tpus.models import Grant, Job, TpuVm
from tpus.tests.jobs_support import account, make_job, make_vm

CLIENT = Path(__file__).resolve().parent.parent


def tpu(home: Path, *args: str) -> subprocess.CompletedProcess:
    """``tpu …`` of this checkout, as the person runs it, in a home of its own."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(CLIENT),
           "no_proxy": "127.0.0.1,localhost", "COLUMNS": "200"}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "tpu_cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.fixture
def pool(live_server, cast, make_user, add_member, tmp_path):
    """Vision's two v4-8, ``a`` running ann's job and ``b`` milo's job moved there from
    a preempted tpu7; waiting for any v4-8: milo's job back from another preempted VM
    (first in line), ann's, then milo's own. milo signed in on a laptop."""
    lab, milo = cast.lab, cast.member
    ann = make_user("ann@vision.example")
    add_member(lab, ann)
    account(milo, "milo")
    account(ann, "ann")
    a, b = (make_vm(lab, name, state=TpuVm.State.READY) for name in "ab")
    for vm in (a, b):
        for user in (milo, ann):
            Grant.objects.create(user=user, vm=vm, state="active")
    hour_ago = timezone.now() - dt.timedelta(hours=1)
    pooled = {"lab": lab, "accelerator_type": "v4-8"}
    make_job(a, ann, "running", started_at=hour_ago, **pooled)
    moved_here = make_job(b, milo, "running", started_at=hour_ago, attempt=2, moved_from="tpu7",
                          moved_why="preempted", placed_at=hour_ago, **pooled)  # fmt: skip
    now = timezone.now()
    waiting = {
        name: make_job(
            None, user, "queued", queued_at=now - dt.timedelta(minutes=m), **fields, **pooled
        )  # fmt: skip
        for name, user, m, fields in (
            ("ann", ann, 30, {}),
            ("milo", milo, 20, {}),
            (
                "back",
                milo,
                10,
                {
                    "attempt": 3,
                    "moved_from": "tpu9",
                    "moved_why": "under maintenance",
                    "returned_at": now,
                },
            ),
        )  # fmt: skip
    }
    home = tmp_path / "home"
    config = home / ".config" / "tpu-portal"
    config.mkdir(parents=True)
    _, token = create_token(milo, "laptop")
    saved = {"url": live_server.url, "token": token, "email": milo.email}
    (config / "credentials.json").write_text(json.dumps(saved))
    (config / "credentials.json").chmod(0o600)
    return home, waiting, moved_here


def test_tpu_jobs_shows_each_pool_jobs_place_why_it_waits_and_where_a_moved_one_came_from(pool):
    home, waiting, moved_here = pool
    done = tpu(home, "jobs")
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    back, mine, anns = waiting["back"], waiting["milo"], waiting["ann"]
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line[:1].isdigit()}
    assert "vision/any v4-8" in rows[str(back.pk)] and "1st in line" in rows[str(back.pk)]
    assert "vision/b" in rows[str(moved_here.pk)] and "running" in rows[str(moved_here.pk)]
    # ann's job came first and both have used the same: fair share keeps that order.
    assert "2nd in line" in rows[str(anns.pk)] and "3rd in line" in rows[str(mine.pk)]
    assert (
        f"Job {mine.pk} (any v4-8, 3rd in line): All 2 v4-8 you may use are busy; 2 jobs "
        "before yours." in said
    )
    assert f"Job {back.pk} (run 3; tpu9 was under maintenance): it waits at the head" in said
    assert f"Job {moved_here.pk} (run 2; tpu7 was preempted): it moved to b." in said

    listed = tpu(home, "jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    jobs = {job["id"]: job for job in json.loads(listed.stdout)}
    assert jobs[back.pk]["position"] == 1 and jobs[mine.pk]["position"] == 3
    assert (jobs[back.pk]["attempt"], jobs[back.pk]["moved_from"]) == (3, "tpu9")
    assert jobs[back.pk]["moved_why"] == "under maintenance"
    assert "2 jobs before yours" in jobs[mine.pk]["reason"]
    assert (jobs[moved_here.pk]["vm"], jobs[moved_here.pk]["attempt"]) == ("b", 2)
    assert jobs[moved_here.pk]["moved_from"] == "tpu7"


def test_tpu_ls_shows_how_many_of_the_persons_jobs_wait_per_kind_and_their_best_place(pool):
    home, waiting, _ = pool
    done = tpu(home, "ls")
    assert done.returncode == 0, done.stderr
    # In the order of their places.
    ids = f"{waiting['back'].pk}, {waiting['milo'].pk}"
    assert (
        f"vision/any v4-8: 2 of your jobs wait ({ids}); the first is 1st in line of 3."
        in done.stdout
    )
    listed = tpu(home, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["vm"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == {"a", "b"}
    for row in rows.values():
        assert row["accelerator_type"] == "v4-8"
        jobs = [waiting["back"].pk, waiting["milo"].pk]
        assert row["my_pool_jobs"] == {"waiting": 2, "best_place": 1, "in_line": 3, "jobs": jobs}


def test_tpu_ls_says_nothing_of_the_pool_when_none_of_the_persons_jobs_wait(pool):
    home, waiting, _ = pool
    Job.objects.filter(pk__in=[waiting["milo"].pk, waiting["back"].pk]).update(state="cancelled")
    done = tpu(home, "ls")
    assert done.returncode == 0, done.stderr
    assert "any v4-8" not in done.stdout
    rows = json.loads(tpu(home, "ls", "--json").stdout)
    assert [row["my_pool_jobs"] for row in rows] == [None, None]


def test_tpu_run_for_a_kind_says_its_place_and_why_it_waits_until_it_is_cancelled(pool):
    home, waiting, _ = pool
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(CLIENT),
           "no_proxy": "127.0.0.1,localhost"}  # fmt: skip
    run = subprocess.Popen(
        [sys.executable, "-m", "tpu_cli", "run", "--type", "v4-8", "--", "python3", "x.py"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = []
        for line in run.stderr:
            lines.append(line)
            if line.startswith("Waiting"):
                break
        job = Job.objects.filter(vm__isnull=True).latest("id")
        assert job.pk not in {j.pk for j in waiting.values()}
        # milo's own jobs are ahead by fair share's order: the new one is 4th.
        assert lines[-1] == (
            "Waiting (4th in line): All 2 v4-8 you may use are busy; 3 jobs before yours.\n"
        ), lines
        Job.objects.filter(pk=job.pk).update(state="cancelled")
        rest = run.communicate(timeout=30)[1]
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1
    assert f"Job {job.pk} cancelled before a VM took it." in rest

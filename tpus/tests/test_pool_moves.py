"""A job submitted to a kind of VM and lost with its VM (preempted, under maintenance,
deleted) whose owner asked to run it again goes to the head of its kind's line, ahead
of fair share, and runs on the next free VM of the kind, not only the one it lost; its
owner hears once where it went; the move is audited and counted, at most ``MAX_MOVES``
times. A job named for its VM still waits for that VM, and one nobody asked to run
again stays lost."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from portal.models import OutboxMessage
from tpus.models import AuditEvent, Grant, Job, TpuVm
from tpus.services import inventory, job_engine, scheduler, sync
from tpus.services.jobs import (
    MAX_MOVES,
    JobSpec,
    Kind,
    run_again_after_preemption,
    submit_pool_job,
)
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

scene = jobs_support.scene
SPEC = JobSpec(args=["python3", "train.py"], rerun_after_preemption=True)


@pytest.fixture
def pool(scene, monkeypatch):
    """Two READY v4-8 of the lab, ``a`` and ``b``, both open to milo and ann (the
    passes placement queues are not run: the tests drive them)."""
    monkeypatch.setattr(scheduler.queue, "advance_jobs", lambda vm_id: None)
    scene.vm.delete()
    scene.a, scene.b = (make_vm(scene.lab, name, state=TpuVm.State.READY) for name in "ab")
    for vm in (scene.a, scene.b):
        for user in (scene.milo, scene.ann):
            Grant.objects.create(user=user, vm=vm, state="active")
    return scene


def running_pool_job(scene, vm, spec=SPEC, **fields) -> Job:
    """milo's pool job, placed on ``vm`` and running there for an hour."""
    fields.setdefault("queued_at", timezone.now() - dt.timedelta(minutes=61))
    return make_job(
        vm,
        scene.milo,
        "running",
        lab=scene.lab,
        accelerator_type="v4-8",
        placed_at=timezone.now(),
        rerun_after_preemption=spec.rerun_after_preemption,
        started_at=timezone.now() - dt.timedelta(hours=1),
        **fields,
    )


def lose(vm, **fields) -> None:
    """Google takes ``vm`` back, and its pass sees it."""
    TpuVm.objects.filter(pk=vm.pk).update(**(fields or {"state": TpuVm.State.PREEMPTED}))
    job_engine.advance(vm.pk)


def mails(kind: str) -> list[OutboxMessage]:
    return list(OutboxMessage.objects.filter(kind=kind))


def test_a_lost_pool_job_goes_to_the_head_of_its_kinds_line_then_runs_on_another_vm(pool):
    job = running_pool_job(pool, pool.a)
    make_job(pool.b, pool.ann, "running")
    # ann's job waited longer and her use is lower: by fair share it would go first.
    theirs = submit_pool_job(pool.ann, pool.lab, Kind("v4-8"), JobSpec(args=["python3", "x.py"]))
    Job.objects.filter(pk=theirs.pk).update(queued_at=timezone.now() - dt.timedelta(hours=2))

    lose(pool.a)

    job.refresh_from_db()
    assert job.state == "lost"
    again = Job.objects.get(rerun_of=job)
    assert again.vm_id is None and again.state == "queued"
    assert (again.attempt, again.moved_from, again.moved_why) == (2, "a", "preempted")
    lines = scheduler.waiting_lines(pool.lab.pk)
    assert lines[again.pk].place == 1 and lines[theirs.pk].place == 2
    # ann's share is not what put the job ahead of hers: her reason does not say so.
    assert lines[theirs.pk].reason == "All 2 v4-8 you may use are busy; 1 job before yours."

    Job.objects.filter(vm=pool.b, state="running").update(state="succeeded")
    placed = scheduler.place(pool.lab.pk)
    assert [(p.job_id, p.vm_id) for p in placed] == [(again.pk, pool.b.pk)]
    again.refresh_from_db()
    assert again.move_text == "a was preempted; your job moved to b."
    # The earlier run keeps its workers' rows and log; its process went with the VM
    # (no worker of a preempted VM is waited for).
    part = job.parts.get()
    assert part.log_tail == "hello from worker 0\n"
    assert (part.state, part.error) == ("lost", "a is preempted: the process went with it")
    [moved] = AuditEvent.objects.filter(action="job.moved")
    assert moved.data == {
        "job": again.pk,
        "rerun_of": job.pk,
        "attempt": 2,
        "from": "a",
        "vm": pool.b.pk,
    }


def test_jobs_back_from_lost_vms_go_first_come_first_served_among_them(pool):
    first = running_pool_job(pool, pool.a)
    second = running_pool_job(pool, pool.b, queued_at=timezone.now() - dt.timedelta(hours=3))
    lose(pool.a)
    lose(pool.b)
    earlier, later = (Job.objects.get(rerun_of=j) for j in (first, second))
    lines = scheduler.waiting_lines(pool.lab.pk)
    # Back in the order they were lost, whenever they were first queued.
    assert (lines[earlier.pk].place, lines[later.pk].place) == (1, 2)


@pytest.mark.parametrize(
    ("lost", "why"),
    [
        ({"state": TpuVm.State.REPAIRING}, "under maintenance"),
        ({"missing_since": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}, "deleted"),
    ],
)
def test_a_pool_job_lost_to_maintenance_or_a_deleted_vm_moves_too(pool, lost, why):
    job = running_pool_job(pool, pool.a)
    lose(pool.a, **lost)
    again = Job.objects.get(rerun_of=job)
    assert again.vm_id == pool.b.pk  # b was free: placed at once
    assert again.move_text == f"a was {why}; your job moved to b."


def test_a_job_named_for_its_vm_still_waits_for_that_vm(pool):
    with_name = make_job(pool.a, pool.milo, "running", rerun_after_preemption=True, lab=pool.lab)
    lose(pool.a)
    again = Job.objects.get(rerun_of=with_name)
    assert again.vm_id == pool.a.pk and again.state == "queued" and again.attempt == 2
    assert not again.moved_from and again.returned_at is None
    assert scheduler.place(pool.lab.pk) == []
    assert mails("job_ended") and not mails("job_moved")


def test_a_pool_job_nobody_asked_to_run_again_ends_lost_as_before(pool):
    job = running_pool_job(pool, pool.a, JobSpec(args=["python3", "train.py"]))
    lose(pool.a)
    job.refresh_from_db()
    assert job.state == "lost" and "preempted" in job.reason
    assert not Job.objects.filter(rerun_of=job).exists()
    assert len(mails("job_ended")) == 1 and not mails("job_moved")


def test_a_job_that_keeps_losing_its_vms_stops_after_the_cap(pool):
    job = running_pool_job(pool, pool.a, attempt=MAX_MOVES + 1)
    lose(pool.a)
    job.refresh_from_db()
    assert job.state == "lost"
    assert not Job.objects.filter(rerun_of=job).exists()
    assert f"moved to another v4-8 {MAX_MOVES} times already" in job.reason
    [told] = mails("job_ended")
    assert "not run again" in told.body
    assert not mails("job_moved")
    # Asked again when the VM is back: still lost, said once.
    assert run_again_after_preemption(job) is None
    job.refresh_from_db()
    assert job.reason.count("not run again") == 1 and len(mails("job_ended")) == 1


def test_the_last_allowed_move_still_happens(pool):
    job = running_pool_job(pool, pool.a, attempt=MAX_MOVES)
    lose(pool.a)
    assert Job.objects.get(rerun_of=job).attempt == MAX_MOVES + 1


def test_its_owner_is_told_once_where_it_went(pool):
    job = running_pool_job(pool, pool.a)
    lose(pool.a)
    again = Job.objects.get(rerun_of=job)
    assert again.vm_id == pool.b.pk
    job_engine.advance(pool.a.pk)
    scheduler.place(pool.lab.pk)
    [told] = mails("job_moved")
    assert told.to == pool.milo.email
    assert "a was preempted; your job moved to b." in told.body
    assert not mails("job_ended")  # not first "lost", then "moved"


def test_a_pool_job_lost_when_its_owner_may_no_longer_run_one_is_told_it_was_lost(pool):
    job = running_pool_job(pool, pool.a)
    Grant.objects.filter(user=pool.milo).update(state="revoked")
    lose(pool.a)
    job.refresh_from_db()
    assert not Job.objects.filter(rerun_of=job).exists()
    assert "It is not run again: You have active access to no v4-8" in job.reason
    assert len(mails("job_ended")) == 1 and not mails("job_moved")


@pytest.fixture
def moved(pool):
    job = running_pool_job(pool, pool.a)
    lose(pool.a)
    return job, Job.objects.get(rerun_of=job)


def test_the_job_page_and_the_api_say_where_it_went(pool, moved, client):
    lost, again = moved
    client.force_login(pool.milo)
    page = client.get(reverse("job_detail", args=["vision", pool.b.pk, again.pk]))
    assert "a was preempted; your job moved to b." in page.content.decode()
    assert reverse("lab_job", args=["vision", lost.pk]) in page.content.decode()
    earlier = client.get(reverse("job_detail", args=["vision", pool.a.pk, lost.pk]))
    text = earlier.content.decode()
    assert "runs again as" in text and reverse("lab_job", args=["vision", again.pk]) in text
    assert "hello from worker 0" in text
    token = create_token(pool.milo, "t")[1]
    answer = client.get(f"/api/v1/me/jobs/{again.pk}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert (answer["attempt"], answer["moved_from"], answer["moved_why"]) == (2, "a", "preempted")
    assert (
        answer["move"] == "a was preempted; your job moved to b." and answer["rerun_of"] == lost.pk
    )


def test_a_moved_job_is_another_labs_404(pool, moved, client, cast):
    _, again = moved
    client.force_login(cast.outsider)
    assert client.get(reverse("lab_job", args=["vision", again.pk])).status_code == 404
    page = client.get(reverse("job_detail", args=["vision", pool.b.pk, again.pk]))
    assert page.status_code == 404
    token = create_token(cast.outsider, "t")[1]
    for path in (f"/me/jobs/{again.pk}", f"/labs/other/jobs/{again.pk}"):
        answer = client.get(f"/api/v1{path}", HTTP_AUTHORIZATION=f"Bearer {token}")
        assert answer.status_code == 404, path


def test_the_sync_that_sees_a_preemption_asks_for_the_vms_pass_at_once(
    tpu_emulator, scene, monkeypatch
):
    """So a job run again elsewhere starts one sync after the loss, not a job poll later."""
    asked = []
    monkeypatch.setattr(sync.queue, "advance_jobs", asked.append)
    scene.lab.gcp_project_id, scene.lab.zones = "vision-lab-1", ["us-central1-f"]
    scene.lab.save()
    for name in ("tpu7", "tpu8"):
        tpu_emulator.controls.add_node(
            "vision-lab-1", "us-central1-f", name, workers=1, preemptible=True
        )
    busy, idle = inventory.import_vms(
        scene.admin, scene.lab, ["us-central1-f/tpu7", "us-central1-f/tpu8"]
    )
    make_job(busy, scene.milo, "running")
    sync.sync_inventory([scene.lab])
    assert asked == []
    tpu_emulator.controls.preempt("tpu7")
    tpu_emulator.controls.preempt("tpu8")
    sync.sync_inventory([scene.lab])
    assert asked == [busy.pk]  # not the VM without a job

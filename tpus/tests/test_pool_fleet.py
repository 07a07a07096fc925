"""The pool on real sshd hosts of the test fleet, with the emulator as the Cloud TPU
API: two v4-8 of the lab, one busy with a job named for it; milo runs a job on "any
free v4-8" through the API, and it is placed on the other one and runs there, start
to end; a second job for the kind waits, saying why, until a VM is free. A pool job
whose VM Google takes back runs again on the other one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from accounts.models import User
from accounts.services import create_token
from accounts.unix import choose_username
from portal.models import OutboxMessage
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.requirements import need
from tpus.models import Job
from tpus.services import inventory, job_engine, scheduler, sync
from tpus.services.grants import grant_access
from tpus.services.jobs import JobSpec, Kind, submit_job, submit_pool_job

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")


@pytest.fixture
def two_v4_8(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    hosts = fleet_hosts(2)
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    for name, host in zip(("tpu5", "tpu6"), hosts, strict=True):
        add_fleet_node(tpu_emulator.controls, fleet, [host], PROJECT, ZONE, name)
    give_lab_key(fleet, hosts, lab)
    vms = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5", f"{ZONE}/tpu6"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    with django_capture_on_commit_callbacks(execute=True):
        grants = grant_access(admin, lab, milo, vms, sudo=False)
    for grant in grants:
        grant.refresh_from_db()
        assert grant.state == "active", grant.error
    for host in hosts:
        fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{fleet_username}/venv"])
    vms = sorted(vms, key=lambda vm: vm.name)
    for vm in vms:
        vm.refresh_from_db()
        assert vm.state == "READY" and vm.accelerator_type == "v4-8"
    yield lab, vms, User.objects.get(pk=milo.pk)
    for job in Job.objects.filter(state__in=["running", "cancelling", "starting"]):
        job_engine.stop_on_workers(job, grace=0)


def _passes_until(job: Job, capture, done, seconds: float = 60) -> Job:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if done(job):
            return job
        with capture(execute=True):
            if job.vm_id is None:
                scheduler.place(job.lab_id)
            else:
                job_engine.advance(job.vm_id)
        time.sleep(0.3)
    pytest.fail(f"job {job.pk} is still {job.state} on {job.vm_id}: {job.reason}")


def test_a_job_for_any_free_v4_8_runs_on_the_free_one_end_to_end(
    client, two_v4_8, django_capture_on_commit_callbacks
):
    lab, (tpu5, tpu6), milo = two_v4_8
    capture = django_capture_on_commit_callbacks
    # tpu5 is busy with a job named for it.
    with capture(execute=True):
        busy = submit_job(
            milo,
            tpu5,
            JobSpec(args=["python", "-c", "import time; time.sleep(60)"], python="~/venv"),
        )
    busy = _passes_until(busy, capture, lambda j: j.state == "running")

    token = create_token(milo, "t")[1]
    body = {
        "accelerator_type": "v4-8",
        "args": ["python", "-c", "import socket; print('pool ran on', socket.gethostname())"],
        "python": "~/venv",
    }
    with capture(execute=True) as callbacks:
        response = client.post(
            "/api/v1/labs/vision/jobs",
            body,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )
    assert response.status_code == 201, response.content
    answer = response.json()
    # Placed at submit: the free VM's pass was queued with the commit (and ran).
    assert answer["vm_id"] == tpu6.pk and answer["vm"] == "tpu6" and callbacks
    job = _passes_until(Job.objects.get(pk=answer["id"]), capture, lambda j: j.has_ended)
    assert job.state == "succeeded", (job.reason, job.preflight)
    assert job.vm_id == tpu6.pk and "pool ran on" in job.parts.get().log_tail

    # Both busy now: another job for the kind waits, and says why.
    with capture(execute=True):
        again = client.post(
            "/api/v1/labs/vision/jobs",
            {**body, "args": ["python", "-c", "print('second')"]},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        ).json()
    assert again["vm_id"] == tpu6.pk  # tpu6 is free again once its job ended
    with capture(execute=True):
        third = client.post(
            "/api/v1/labs/vision/jobs",
            {**body, "args": ["python", "-c", "print('third')"]},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        ).json()
    assert third["vm_id"] is None
    assert third["reason"] == "All 2 v4-8 you may use are busy; 0 jobs before yours."
    assert third["url"].endswith(f"/labs/vision/jobs/{third['id']}/")
    # tpu5's job is cancelled: its pass ends it and gives tpu5 to the waiting job.
    from tpus.services.jobs import cancel_job

    with capture(execute=True):
        cancel_job(busy, milo)
    third_job = _passes_until(
        Job.objects.get(pk=third["id"]), capture, lambda j: j.vm_id is not None
    )
    assert third_job.vm_id in (tpu5.pk, tpu6.pk)
    third_job = _passes_until(third_job, capture, lambda j: j.has_ended)
    assert third_job.state == "succeeded", (third_job.reason, third_job.preflight)


def test_a_pool_job_on_a_preempted_vm_runs_again_on_the_other_vm_of_its_kind(
    two_v4_8, tpu_emulator, django_capture_on_commit_callbacks
):
    lab, (tpu5, tpu6), milo = two_v4_8
    capture = django_capture_on_commit_callbacks
    spec = JobSpec(
        args=["python", "-c", "import socket, time; print('on', socket.gethostname()); "
              "time.sleep(6)"],
        python="~/venv",
        rerun_after_preemption=True,
    )  # fmt: skip
    with capture(execute=True):
        job = submit_pool_job(milo, lab, Kind("v4-8"), spec)
    job = _passes_until(job, capture, lambda j: j.state == "running")
    assert job.vm_id == tpu5.pk  # the first free one by name

    # Google takes tpu5 back; the sync sees it, and tpu5's pass finds the job lost.
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    with capture(execute=True):
        job_engine.advance(tpu5.pk)
    job.refresh_from_db()
    assert job.state == "lost" and "preempted" in job.reason

    again = Job.objects.get(rerun_of=job)
    assert (
        again.vm_id == tpu6.pk and again.move_text == "tpu5 was preempted; your job moved to tpu6."
    )
    again = _passes_until(again, capture, lambda j: j.has_ended)
    assert again.state == "succeeded", (again.reason, again.preflight)
    assert again.parts.get().log_tail.startswith("on ")
    [told] = OutboxMessage.objects.filter(kind="job_moved")
    assert told.subject.endswith(f"Job {job.pk} moved from tpu5 to tpu6")

"""The demo's old trap, on real hosts: a pod job whose workers cannot reach worker 0's
coordinator waits in ``jax.distributed.initialize()`` without printing a line. Its page
says so after a while, naming the address the workers wait for, instead of showing
nothing forever."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from django.urls import reverse

from accounts.keys import add_key
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.requirements import need
from tpus.models import Job
from tpus.services import inventory, job_engine
from tpus.services.grants import grant_access
from tpus.services.jobs import cancel_job
from tpus.views import jobs as job_views

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
INIT = (
    "import os, jax; jax.distributed.initialize(os.environ['TPU_PORTAL_COORDINATOR'], "
    "int(os.environ['TPU_PORTAL_NUM_PROCESSES']), int(os.environ['TPU_PORTAL_PROCESS_ID'])); "
    "print('connected', flush=True)"
)


@pytest.fixture
def pod(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    hosts = fleet_hosts(2)
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "pod5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/pod5"])
    # Worker 0's internal address is one nothing answers on, as the demo's made-up
    # 10.128.0.2 was: the other worker (and worker 0 itself) cannot reach it.
    unreachable = fleet.free_ip()
    vm.workers.filter(index=0).update(internal_ip=unreachable)
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    add_key(milo, key.with_suffix(".pub").read_text().strip())
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    for host in hosts:
        fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{fleet_username}/venv"])
    return vm, milo, unreachable


def _advance(vm, capture) -> None:
    with capture(execute=True):
        job_engine.advance(vm.pk)


def test_a_pod_that_cannot_reach_its_coordinator_is_said_to_wait_for_it(
    client, pod, settings, monkeypatch, django_capture_on_commit_callbacks
):
    vm, milo, unreachable = pod
    monkeypatch.setattr(job_views, "QUIET_AFTER_SECONDS", 4)
    settings.PORTAL_JOB_CANCEL_GRACE_SECONDS = 1
    client.force_login(milo)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("job_submit", args=["vision", vm.pk]),
            {"command": f'python -c "{INIT}"', "python": "~/venv"},
        )
    assert response.status_code == 302, response.content.decode()[-2000:]
    job = Job.objects.get()
    live_url = reverse("job_live", args=["vision", vm.pk, job.pk])
    try:
        deadline = time.monotonic() + 40
        live = ""
        # Each worker's quiet time counts from its own start: under load worker 0 can
        # be named alone first, until the others cross the threshold too.
        while "No output yet from any worker after" not in live:
            assert time.monotonic() < deadline, (job.state, job.reason, live[-3000:])
            _advance(vm, django_capture_on_commit_callbacks)
            job.refresh_from_db()
            assert not job.has_ended, (job.state, job.reason, job.preflight)
            live = client.get(live_url).content.decode()
            time.sleep(0.5)
        assert job.state == "running"
        note = live[live.index('id="job-quiet"') :].split("</p>")[0]
        assert "No output yet from any worker after" in note
        port = settings.PORTAL_JOB_COORDINATOR_PORT
        assert f"coordinator at <code>{unreachable}:{port}</code>" in note
        assert "(nothing yet)" in live  # and the logs are empty indeed
    finally:
        with django_capture_on_commit_callbacks(execute=True):
            cancel_job(Job.objects.get(pk=job.pk), milo)
        deadline = time.monotonic() + 60
        while not Job.objects.get(pk=job.pk).has_ended and time.monotonic() < deadline:
            _advance(vm, django_capture_on_commit_callbacks)
            time.sleep(0.5)
    assert Job.objects.get(pk=job.pk).state == "cancelled"

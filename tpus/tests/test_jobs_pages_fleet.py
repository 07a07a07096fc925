"""A job through the pages on a real sshd host of the test fleet, with the emulator as
the Cloud TPU API: milo queues it with the form, the VM's pass starts it, its page
shows the end of the log, the download gives the whole log from the worker, and the
``ssh … tail`` line the page shows works with milo's ssh config and a real ssh client."""

from __future__ import annotations

import os
import re
import subprocess
import time
from html import unescape
from pathlib import Path

import pytest
from django.urls import reverse

from accounts.keys import add_key
from accounts.models import User
from accounts.services import create_token
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.requirements import need
from tpus.models import Job
from tpus.services import inventory, job_engine, sshconfig
from tpus.services.grants import grant_access

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
LINES = 3000


def milo_granted_on_tpu5(
    tpu_emulator, fleet, host, username, tmp_path,
    make_lab, make_user, add_member, capture,
):  # fmt: skip
    """The scene the jobs' fleet tests on one host share: the lab vision with its admin,
    tpu5 made of ``host`` and imported, and milo (``username`` on the hosts, his key at
    ``tmp_path/id_milo``) granted on it and active. Returns (lab, admin, vm, milo, key)."""
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, [host], PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, [host], lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, username)
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    add_key(milo, key.with_suffix(".pub").read_text().strip())
    with capture(execute=True):
        [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    return lab, admin, vm, milo, key


@pytest.fixture
def tpu5(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    [host] = fleet_hosts(1)
    lab, admin, vm, milo, key = milo_granted_on_tpu5(
        tpu_emulator, fleet, host, fleet_username, tmp_path,
        make_lab, make_user, add_member, django_capture_on_commit_callbacks,
    )  # fmt: skip
    # The fleet's JAX, as milo's own venv (a venv outside the home is refused).
    fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{fleet_username}/venv"])
    return vm, User.objects.get(pk=milo.pk), key, tmp_path


def _wait_until_ended(job: Job, capture, seconds: float = 30) -> Job:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with capture(execute=True):
            job_engine.advance(job.vm_id)
        job.refresh_from_db()
        if job.has_ended:
            return job
        time.sleep(0.3)
    pytest.fail(f"job {job.pk} is still {job.state}: {job.reason}")


@pytest.mark.parametrize(
    "tail_bytes", [32768, 4096], ids=["whole-log-kept", "more-than-the-kept-tail"]
)
def test_a_job_queued_with_the_form_runs_and_its_whole_log_downloads(
    client, tpu5, settings, django_capture_on_commit_callbacks, tail_bytes
):
    vm, milo, key, tmp = tpu5
    # The log is about 29 KB: all of it, or less than it, is kept for the page.
    settings.PORTAL_JOB_LOG_TAIL_BYTES = tail_bytes
    client.force_login(milo)
    program = f"for n in range({LINES}): print(f'line {{n}}', flush=True)"
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            reverse("job_submit", args=["vision", vm.pk]),
            {"command": f'python -c "{program}"', "python": "~/venv", "use_tcmalloc": "on"},
        )
    assert response.status_code == 302, response.content.decode()[-2000:]
    job = _wait_until_ended(Job.objects.get(), django_capture_on_commit_callbacks)
    assert job.state == "succeeded", (job.reason, job.preflight)
    # A reconcile after the job started (someone else's grant, a key) keeps the way to
    # the job's folder open to milo.
    from tpus.services import hosts, reconcile

    hosts.hosts_must_change(vm, "a key changed")
    reconcile.reconcile_vm(vm.pk)

    live = client.get(reverse("job_live", args=["vision", vm.pk, job.pk])).content.decode()
    assert "Succeeded" in live and "exit 0" in live and "hx-trigger" not in live
    assert f"line {LINES - 1}" in live and "line 0\n" not in live  # the page shows the end

    url = reverse("job_log", args=["vision", vm.pk, job.pk, 0])
    download = client.get(url)
    assert download.status_code == 200 and download["Content-Type"].startswith("text/plain")
    assert "attachment" in download["Content-Disposition"]
    whole = b"".join(download.streaming_content).decode()
    assert whole.splitlines() == [f"line {n}" for n in range(LINES)]

    token = create_token(milo, "t")[1]
    api = client.get(
        f"/api/v1/labs/vision/vms/{vm.pk}/jobs/{job.pk}/workers/0/log",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert b"".join(api.streaming_content).decode() == whole

    # The line the page shows, with milo's ssh config, as a real ssh client runs it.
    [line] = re.findall(r"<code>(ssh \S+ tail -f \S+)</code>", live)
    _, host, _, _, path = unescape(line).split()
    assert host == "tpu5" and path == f"/var/lib/tpu-portal/jobs/{job.host_id}/log"
    config, known = tmp / "config", tmp / "known_hosts"
    config.write_text(sshconfig.render_config(milo))
    known.write_text(sshconfig.render_known_hosts(sshconfig.vms_for(milo)))

    def as_milo(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", str(config), "-i", str(key), "-o", "IdentitiesOnly=yes",
             "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, command],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    done = as_milo(f"tail -n 2 {path}")
    if done.returncode != 0:
        folders = f"/var/lib/tpu-portal /var/lib/tpu-portal/jobs {path.rsplit('/', 1)[0]} {path}"
        seen = as_milo(f"id; ls -lnd {folders}")
        raise AssertionError(f"{done.stderr}\n{seen.stdout}{seen.stderr}")
    assert done.stdout.splitlines() == [f"line {LINES - 2}", f"line {LINES - 1}"]

"""A Celery worker killed in the middle of a reconcile: nothing is half-done that the
next run does not finish. Real worker processes, real broker, real sshd fleet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpus.models import Grant, TpuVm
from tpus.services.grants import grant_access
from tpus.services.maintenance import vms_to_reconcile
from tpus.tasks import reconcile_vm
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _worker(env_for_children: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "portal", "worker", "--pool=solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat",
         "-Q", env_for_children["PORTAL_TEST_QUEUE"], "--loglevel=INFO"],
        cwd=ROOT, env={**os.environ, **env_for_children},
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _wait(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.1)


def test_a_worker_killed_mid_reconcile_is_finished_by_the_next_run(
    pod,  # noqa: F811
    celery_worker_process,
    settings,
    tmp_path,
):
    settings.PORTAL_RECONCILE_CLAIM_SECONDS = 3
    env = {
        **celery_worker_process.env_for_children,
        "PORTAL_TEST_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "PORTAL_RECONCILE_CLAIM_SECONDS": "3",
        "PORTAL_ADMIN_SSH_KEY_FILE": settings.PORTAL_ADMIN_SSH_KEY_FILE,
        "PORTAL_ADMIN_SSH_USER": settings.PORTAL_ADMIN_SSH_USER,
        "PORTAL_REMOTE_CONNECT_TIMEOUT": "5",
        "PORTAL_UID_MIN": str(settings.PORTAL_UID_MIN),
        "PORTAL_UID_MAX": str(settings.PORTAL_UID_MAX),
    }
    # The fixture's worker does not know the fleet's key; replace it with one that does.
    os.killpg(celery_worker_process.pid, signal.SIGKILL)
    first = _worker(env, tmp_path / "first.log")
    # One worker hangs like a dead VM, so the run is still going when the kill comes.
    slow = pod.hosts[3]
    pod.fleet.down(slow.name, hang=True)
    grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    vm = TpuVm.objects.get(pk=pod.vm.pk)
    _wait(lambda: TpuVm.objects.get(pk=vm.pk).reconcile_claimed_until is not None, 30, "a claim")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    pod.fleet.start(slow.name)
    assert Grant.objects.get(user=pod.milo, vm=vm).state == "pending"
    second = _worker(env, tmp_path / "second.log")
    try:
        # What the periodic sweep does: the pending grant brings the VM back.
        assert vm.pk in vms_to_reconcile()
        time.sleep(3.5)  # the dead run's claim lapses
        reconcile_vm.delay(vm.pk)
        _wait(lambda: Grant.objects.get(user=pod.milo, vm=vm).state == "active", 60, "the grant")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=20)
    for host in ("tpu5-w0", "tpu5-w3"):
        assert pod.ssh(host).returncode == 0

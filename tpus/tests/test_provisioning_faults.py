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

from tests.e2e import ends_with_this_process
from tpus.models import Grant, TpuVm
from tpus.services.grants import grant_access, revoke_access
from tpus.services.maintenance import vms_to_reconcile
from tpus.tasks import release_stalled_claims
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
        preexec_fn=ends_with_this_process,
    )  # fmt: skip


def _short_lease_worker_env(celery_worker_process, settings) -> dict:
    """The environment of a Celery worker that shares this test's world, with 3-second
    reconcile leases (so a dead run is noticed quickly) and this test's UID range."""
    settings.PORTAL_RECONCILE_CLAIM_SECONDS = 3
    return {
        **celery_worker_process.env_for_children,
        "PORTAL_TEST_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "PORTAL_RECONCILE_CLAIM_SECONDS": "3",
        "PORTAL_REMOTE_CONNECT_TIMEOUT": "5",
        "PORTAL_UID_MIN": str(settings.PORTAL_UID_MIN),
        "PORTAL_UID_MAX": str(settings.PORTAL_UID_MAX),
    }


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
    env = _short_lease_worker_env(celery_worker_process, settings)
    # The fixture's worker has the default lease; replace it with one that has 3 s.
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
    killed_at = time.monotonic()
    try:
        # What the periodic sweep does: the pending grant brings the VM back.
        assert vm.pk in vms_to_reconcile()

        # What beat does every PORTAL_STALLED_CHECK_SECONDS: the dead run stopped
        # renewing its lease, so its claim is released and the VM runs again.
        def active() -> bool:
            release_stalled_claims.delay()
            return Grant.objects.get(user=pod.milo, vm=vm).state == "active"

        _wait(active, 60, "the grant")
        print(f"kill -9 mid-reconcile → grant active in {time.monotonic() - killed_at:.1f} s")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=20)
    for host in ("tpu5-w0", "tpu5-w3"):
        assert pod.ssh(host).returncode == 0


def _database_outage(seconds: float) -> None:
    """The test database refuses connections for ``seconds`` and every session on it
    but this test's own is cut, as a PostgreSQL restart does to the worker. Done from
    a session on the server's maintenance database, so the test keeps its own."""
    import psycopg
    from django.db import connection

    params = connection.settings_dict
    name = params["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        [mine] = cursor.fetchone()
    with psycopg.connect(
        host=params["HOST"], port=params["PORT"] or 5432, user=params["USER"],
        password=params["PASSWORD"], dbname="postgres", autocommit=True,
    ) as admin:  # fmt: skip
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> %s",
                [name, mine],
            )
            time.sleep(seconds)
        finally:
            admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


def test_a_revoke_interrupted_by_a_database_outage_completes_soon_after(
    pod,  # noqa: F811
    celery_worker_process,
    settings,
    tmp_path,
    django_capture_on_commit_callbacks,
):
    from django.db import connection

    if connection.vendor != "postgresql":
        # The embedded backend has no server to take away; the services run covers it.
        pytest.skip("a database outage needs PostgreSQL (PORTAL_TEST_BACKEND=services)")
    env = _short_lease_worker_env(celery_worker_process, settings)
    os.killpg(celery_worker_process.pid, signal.SIGKILL)
    worker = _worker(env, tmp_path / "worker.log")
    try:
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
        _wait(lambda: Grant.objects.get(pk=grant.pk).state == "active", 60, "the grant")
        assert pod.ssh("tpu5-w0").returncode == 0
        # One worker hangs like a dead VM, so the revoke is mid-run when the database goes.
        slow = pod.hosts[3]
        pod.fleet.down(slow.name, hang=True)
        revoke_access(pod.admin, Grant.objects.get(pk=grant.pk))
        _wait(lambda: TpuVm.objects.get(pk=pod.vm.pk).reconcile_claimed_until is not None, 30,
              "the revoke's reconcile")  # fmt: skip
        outage_at = time.monotonic()
        _database_outage(8)
        pod.fleet.start(slow.name)

        def revoked() -> bool:
            release_stalled_claims.delay()  # what beat does every few seconds
            return Grant.objects.get(pk=grant.pk).state == "revoked"

        _wait(revoked, 90, "the revoke")
        took = time.monotonic() - outage_at
        print(f"database outage (8 s) mid-revoke → revoked {took:.1f} s after it began")
        assert took < 70
        for host in ("tpu5-w0", "tpu5-w3"):
            assert pod.ssh(host).returncode != 0
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=20)


def _ready(log: Path, seconds: float = 60) -> None:
    """Wait until the Celery worker writing ``log`` takes tasks."""
    _wait(lambda: log.exists() and " ready." in log.read_text(errors="replace"), seconds,
          "the worker to start")  # fmt: skip


def _seconds_until_refused(login, aliases: list[str], limit: float) -> float:
    """Try ``ssh`` as the person on each worker (each on its own, one attempt at most
    every half second) from now until every worker refuses them; how long until the
    last worker's first refused attempt ended. A refusal must be sshd's, not a
    connection that failed."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()

    def until_refused(alias: str) -> float:
        while True:
            tried = time.monotonic()
            result = login(alias)
            if result.returncode != 0:
                assert result.returncode == 255 and "in" not in result.stdout.split(), result
                for failure in ("timed out", "No route", "resolve", "Connection refused"):
                    assert failure not in result.stderr, result.stderr
                return time.monotonic() - start
            if time.monotonic() - start > limit:
                raise AssertionError(f"{alias}: still logging in {limit} s after the revoke")
            time.sleep(max(0.0, 0.5 - (time.monotonic() - tried)))

    with ThreadPoolExecutor(len(aliases)) as pool:
        return max(pool.map(until_refused, aliases))


def _login_with_config_of_now(pod_):
    """Plain ssh as the person with the config and known_hosts they hold now (written
    once: after the revoke the portal leaves the VM out of a fresh one)."""
    config, known = pod_.write_config(pod_.milo)

    def login(alias: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", str(config), "-i", str(pod_.key), "-o", "IdentitiesOnly=yes",
             "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
             alias, "echo in"],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    return login


def _what_the_worker_holds(pod_, host) -> str:
    """For a login that should have worked and did not: the person's account and keys
    file on the worker, the lab key the portal logs in with there, and what its sshd
    logged last (which keys logged in as the portal's account, and when it refused)."""
    from tpus.services.labkeys import lab_key

    user = pod_.milo.unix_account.username
    held = pod_.fleet.exec(host.name, ["/bin/sh", "-c", (
        f"ls -l /etc/ssh/tpu-portal-keys; grep '^{user}:' /etc/passwd /etc/shadow; "
        "ssh-keygen -lf /home/tpu-portal/.ssh/authorized_keys"
    )], check=False)  # fmt: skip
    return (
        f"{host.name} ({host.ip}) refused {user}; the lab's key is "
        f"{lab_key(pod_.lab).fingerprint}\n{held.stdout.decode(errors='replace')}"
        f"{held.stderr.decode(errors='replace')}\nsshd:\n{pod_.fleet.log(host.name)[-4000:]}"
    )


@pytest.mark.parametrize("death", ["kill -9 of the Celery worker", "PostgreSQL restart"])
def test_a_revoke_refuses_the_person_on_every_worker_within_5_s_whatever_died_before(
    pod,  # noqa: F811
    celery_worker_process,
    settings,
    tmp_path,
    death,
):
    """Production lease and stalled-claim settings: the revoke does not wait for them."""
    from django.db import connection

    if death == "PostgreSQL restart" and connection.vendor != "postgresql":
        pytest.skip("a database outage needs PostgreSQL (PORTAL_TEST_BACKEND=services)")
    assert settings.PORTAL_RECONCILE_CLAIM_SECONDS == 30
    env = {
        **celery_worker_process.env_for_children,
        "PORTAL_TEST_QUEUE": settings.CELERY_TASK_DEFAULT_QUEUE,
        "PORTAL_REMOTE_CONNECT_TIMEOUT": "20",  # the holder stays mid-run long enough
        "PORTAL_UID_MIN": str(settings.PORTAL_UID_MIN),
        "PORTAL_UID_MAX": str(settings.PORTAL_UID_MAX),
    }
    os.killpg(celery_worker_process.pid, signal.SIGKILL)
    first = _worker(env, tmp_path / "first.log")
    second = None
    aliases = [f"tpu5-w{i}" for i in range(4)]
    try:
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
        _wait(lambda: Grant.objects.get(pk=grant.pk).state == "active", 60, "the grant")
        # A reconcile of the VM is under way (one worker hangs like a dead VM) when
        # its holder dies: the worker process is killed, or PostgreSQL restarts under it.
        slow = pod.hosts[3]
        pod.fleet.down(slow.name, hang=True)
        [changed] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=True)
        _wait(lambda: TpuVm.objects.get(pk=pod.vm.pk).reconcile_claim_version == changed.version,
              30, "a reconcile to be under way")  # fmt: skip
        if death.startswith("kill"):
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            second = _worker(env, tmp_path / "second.log")
            _ready(tmp_path / "second.log")
        else:
            _database_outage(3)
        pod.fleet.start(slow.name)
        vm = TpuVm.objects.get(pk=pod.vm.pk)
        assert vm.reconcile_claimed_until is not None  # the dead run's lease is still on
        login = _login_with_config_of_now(pod)
        for alias, host in zip(aliases, pod.hosts, strict=True):
            assert login(alias).returncode == 0, _what_the_worker_holds(pod, host)

        revoke_access(pod.admin, Grant.objects.get(pk=grant.pk))
        took = _seconds_until_refused(login, aliases, 30)

        print(f"{death} → revoke refused on 4 workers after {took:.1f} s")
        assert took <= 5
        _wait(lambda: Grant.objects.get(pk=grant.pk).state == "revoked", 60, "the revoke")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=20)

"""Jobs through the portal on real sshd hosts of the test fleet, with real JAX (the CPU
build) as the job: a person with access submits, the VM's pass validates and starts the
job on every worker, polls it, and stops it; the queue, cancel, a failed or rebooted
worker of a pod, a revoke, a chip held outside the portal, refusals."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.conf import settings
from django.core import mail
from django.core.exceptions import PermissionDenied, ValidationError

from tpus.models import Job, JobWorker, TpuVm
from tpus.models.jobs import JobState
from tpus.remote.kept import kept
from tpus.services import job_engine, jobs
from tpus.services.grants import grant_access, revoke_access
from tpus.tests.test_jobs_host import JAX_ENV, POD_PY, PS, live_processes
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)

pytestmark = pytest.mark.fleet

XLA = ("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


@pytest.fixture
def jobs_pod(pod, django_capture_on_commit_callbacks, jax_env):  # noqa: F811
    """The 4-worker pod with milo's access in force, JAX in his home (a link to the
    fleet's CPU build) and the pod script on every worker."""
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    pod.user = pod.fresh(pod.milo).unix_account.username
    pod.home = f"/home/{pod.user}"
    for host in pod.hosts:
        sh(pod, host, f"ln -sfn {JAX_ENV} {pod.home}/jax && chown -h {pod.user}: {pod.home}/jax")
        put(pod, host, "pod.py", POD_PY)
    pod.vm.refresh_from_db()
    yield pod
    # Nothing of a test's jobs may outlive it on the shared hosts.
    for job in Job.objects.filter(vm=pod.vm, state__in=["running", "cancelling", "starting"]):
        job_engine.stop_on_workers(job, grace=0)


@pytest.fixture
def jax_env():
    from pathlib import Path

    from tests.requirements import need

    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    return JAX_ENV


def sh(pod, host, script: str, *, input: bytes | None = None) -> str:  # noqa: F811
    return pod.fleet.exec(host.name, ["sh", "-c", script], input=input).stdout.decode()


def put(pod, host, name: str, text: str) -> None:  # noqa: F811
    path = f"{pod.home}/{name}"
    sh(pod, host, f"cat > {path} && chown {pod.user}: {path}", input=text.encode())


def spec(**options) -> jobs.JobSpec:
    values = {"script": "pod.py", "python": "~/jax", "env": [XLA]}
    values.update(options)
    return jobs.JobSpec(**values)


def submit(pod, capture, **options) -> Job:  # noqa: F811
    """Submit as milo without running the queued pass (the test drives passes)."""
    with capture(execute=False):
        return jobs.submit_job(pod.milo, pod.vm, spec(**options))


def drive(vm: TpuVm, job: Job, until, timeout: float = 90.0) -> Job:
    """Run the VM's pass until ``until(job)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        job_engine.advance(vm.pk)
        job.refresh_from_db()
        if until(job) or time.monotonic() > deadline:
            return job
        time.sleep(0.3)


def logins(pod, host) -> int:  # noqa: F811
    return pod.fleet.log(host.name).count("Accepted publickey for")


def commands(pod, host) -> int:  # noqa: F811
    return pod.fleet.log(host.name).count("Starting session: command")


def runs(pod) -> int:  # noqa: F811
    """Scripts run on the pod's workers: execs, and requests to connections' kept
    shells (whose starts are execs too)."""
    execs = sum(commands(pod, host) for host in pod.hosts)
    return execs + kept.counts.shell_runs - kept.counts.shells


def logs(job: Job) -> list[str]:
    return [p.log_tail for p in job.parts.order_by("index")]


# --- a pod ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_pod_job_runs_one_collective_on_every_worker_and_succeeds(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(jobs_pod, django_capture_on_commit_callbacks, notify=True)
    assert job.state == JobState.QUEUED
    began = time.monotonic()
    report = job_engine.advance(jobs_pod.vm.pk)
    print(f"\nsubmit -> running on 4 workers through the portal: {time.monotonic() - began:.2f} s")
    job.refresh_from_db()
    assert report.started == [job.pk] and job.state == JobState.RUNNING, job.reason
    parts = list(job.parts.order_by("index"))
    assert [p.state for p in parts] == ["running"] * 4 and all(p.pid for p in parts)
    assert job.worker_count == 4  # what usage multiplies its time by
    assert {c[0] for c in job.preflight["0"]} >= {"chips", "python", "script", "port"}

    with django_capture_on_commit_callbacks(execute=True):
        job = drive(jobs_pod.vm, job, lambda j: j.has_ended)
    assert job.state == JobState.SUCCEEDED, (job.reason, logs(job))
    for index, log in enumerate(logs(job)):
        assert f"process {index} devices 16 sum 120.0" in log, log
    assert [p.exit_status for p in job.parts.order_by("index")] == [0, 0, 0, 0]
    # "Email me when it ends": one message, with the exit of each worker.
    [message] = [m for m in mail.outbox if "Job" in m.subject]
    assert message.to == [jobs_pod.milo.email] and "succeeded" in message.subject
    assert "Worker 3: exit 0" in message.body and "devices 16" in message.body


@pytest.mark.slow
def test_one_job_at_a_time_the_next_starts_in_the_pass_that_ends_the_first(
    jobs_pod, django_capture_on_commit_callbacks
):
    first = submit(jobs_pod, django_capture_on_commit_callbacks, args=["stay"])
    second = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["hostname"])
    job_engine.advance(jobs_pod.vm.pk)
    first = drive(jobs_pod.vm, first, lambda j: "staying" in "".join(logs(j)))
    second.refresh_from_db()
    assert (first.state, second.state) == (JobState.RUNNING, JobState.QUEUED)

    # Cancel: TERM, the grace period, KILL on every worker; the lock is freed, and the
    # same pass starts the job that waited.
    with django_capture_on_commit_callbacks(execute=False):
        jobs.cancel_job(first, jobs_pod.milo)
    before = [logins(jobs_pod, host) for host in jobs_pod.hosts]
    began = time.monotonic()
    report = job_engine.advance(jobs_pod.vm.pk)
    took = time.monotonic() - began
    first.refresh_from_db()
    second.refresh_from_db()
    print(f"\ncancel on 4 workers and the next job started in one pass: {took:.2f} s")
    assert first.state == JobState.CANCELLED and report.ended[0] == first.pk
    assert report.started == [second.pk]
    # No login at all for the whole pass (the stop, then the next job's start): it
    # uses the connections kept open since the passes before.
    after = [logins(jobs_pod, host) for host in jobs_pod.hosts]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 0, 0, 0]
    assert all(p.state == "ended" for p in first.parts.all())
    for host, part in zip(jobs_pod.hosts, first.parts.order_by("index"), strict=True):
        left = sh(jobs_pod, host, f"ps -e -o pgid= | grep -cx ' *{part.pid}' || true").strip()
        assert left == "0", f"{host.name}: processes of the cancelled job are left"
    second = drive(jobs_pod.vm, second, lambda j: j.has_ended)
    assert second.state == JobState.SUCCEEDED
    assert [p.log_tail.strip() for p in second.parts.order_by("index")] == [
        h.hostname for h in jobs_pod.hosts
    ]


@pytest.mark.slow
def test_a_worker_whose_process_dies_fails_the_job_naming_it_and_the_others_stop(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(jobs_pod, django_capture_on_commit_callbacks, args=["stay"])
    job = drive(jobs_pod.vm, job, lambda j: all("staying" in t for t in logs(j)))
    victim = job.parts.get(index=2)
    sh(jobs_pod, jobs_pod.hosts[2], f"kill -KILL {victim.pid}")
    began = time.monotonic()
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    took = time.monotonic() - began
    print(f"\none worker killed -> every worker stopped and the job failed in {took:.2f} s")
    assert job.state == JobState.FAILED
    assert job.reason.startswith("Worker 2 (tpu5-w2) killed by KILL"), job.reason
    assert all(p.state == "ended" for p in job.parts.all())
    assert took < 20  # not JAX's 100 s heartbeat


@pytest.mark.slow
def test_a_reboot_mid_run_loses_the_job_and_tells_the_person(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    jobs_pod.fleet.reboot(jobs_pod.hosts[1].name)
    with django_capture_on_commit_callbacks(execute=True):
        job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.LOST, job.reason
    assert "Worker 1 (tpu5-w1) rebooted" in job.reason
    # Lost is always told, even without "email me".
    assert any("lost" in m.subject and m.to == [jobs_pod.milo.email] for m in mail.outbox)


@pytest.mark.slow
def test_revoking_access_stops_the_persons_running_job(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    grant = jobs_pod.milo.grants.get(vm=jobs_pod.vm)
    with django_capture_on_commit_callbacks(execute=True):
        revoke_access(jobs_pod.admin, grant)
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.CANCELLED and "revoked" in job.reason
    for host in jobs_pod.hosts:
        assert "sleep 300" not in sh(jobs_pod, host, "ps -e -o args=")


@pytest.mark.slow
def test_deleting_the_vm_stops_its_running_job_as_a_cancel_first_then_deletes_it(
    jobs_pod, django_capture_on_commit_callbacks, tpu_emulator
):
    from portal.models import OutboxMessage
    from tpus.services import vm_lifecycle

    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    before = OutboxMessage.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    with django_capture_on_commit_callbacks(execute=False):
        vm_lifecycle.delete_vm(jobs_pod.admin, jobs_pod.vm, "tpu5")
    # The call waits while the job is being stopped on the workers …
    with django_capture_on_commit_callbacks(execute=False):
        again = vm_lifecycle.run(jobs_pod.vm.pk, vm_lifecycle.DELETE)
    assert again == vm_lifecycle.JOB_STOP_RECHECK_SECONDS
    assert tpu_emulator.requests["DeleteNode"] == 0
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.CANCELLED and "being deleted" in job.reason
    for host in jobs_pod.hosts:
        assert "sleep 300" not in sh(jobs_pod, host, "ps -e -o args=")
    # … then deletes the VM.
    assert vm_lifecycle.run(jobs_pod.vm.pk, vm_lifecycle.DELETE) is None
    assert tpu_emulator.requests["DeleteNode"] == 1
    assert tpu_emulator.client.list_nodes("vision-lab-1", "us-central1-f") == []
    # Milo hears it once: the VM is deleted (his job's end was not asked to be told).
    told = OutboxMessage.objects.filter(to=jobs_pod.milo.email, pk__gt=before)
    assert [m.kind for m in told] == ["vm_deleted"]


# --- refusals and the TPU held outside the portal ---------------------------------------


def test_a_script_that_differs_on_one_worker_is_rejected_naming_it(
    jobs_pod, django_capture_on_commit_callbacks
):
    put(jobs_pod, jobs_pod.hosts[3], "pod.py", POD_PY + "# changed\n")
    job = submit(jobs_pod, django_capture_on_commit_callbacks)
    job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.REJECTED
    assert "worker 3 (tpu5-w3): script: differs from worker 0's copy" in job.reason
    assert not JobWorker.objects.filter(job=job, pid__isnull=False).exists()


def test_a_check_failing_on_one_worker_starts_the_job_on_no_worker(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "30"])
    before = runs(jobs_pod)
    port = settings.PORTAL_JOB_COORDINATOR_PORT
    listen = f"import socket, time; s = socket.socket(); s.bind(('', {port})); s.listen(); "
    # The coordinator's port is taken on worker 0: its pre-flight fails, the others pass.
    sh(jobs_pod, jobs_pod.hosts[0], f'python3 -c "{listen}time.sleep(60)" >/dev/null 2>&1 & '
       "echo $! >/tmp/listener.pid")  # fmt: skip
    try:
        time.sleep(0.5)
        report = job_engine.advance(jobs_pod.vm.pk)
    finally:
        # (The file goes too: another test of the same host looks for an empty /tmp.)
        sh(jobs_pod, jobs_pod.hosts[0],
           "kill -KILL $(cat /tmp/listener.pid); rm -f /tmp/listener.pid")  # fmt: skip
    job.refresh_from_db()
    assert job.state == JobState.REJECTED and report.started == []
    assert "worker 0 (tpu5-w0): port:" in job.reason, job.reason
    # Every worker ran the pre-flight (one run each, an exec or a request to the kept
    # shell, waiting for the word), none started.
    assert runs(jobs_pod) - before == len(jobs_pod.hosts)
    time.sleep(0.3)
    for host in jobs_pod.hosts:
        assert job.host_id not in sh(jobs_pod, host, "ls /var/lib/tpu-portal/jobs/ || true")
        # Nothing waits for a word that will never come: no exec, nothing under a kept
        # shell (an idle one runs nothing).
        assert sh(jobs_pod, host, "pgrep -f 'tpu-portal-[s]tep' || true").strip() == ""
        rows = [line.split(None, 4) for line in sh(jobs_pod, host, PS).splitlines()]
        shells = {r[1] for r in rows if len(r) == 5 and r[4].startswith("/bin/sh -c ")
                  and r[4].endswith(" tpu-portal-shell")}  # fmt: skip
        assert [r[4] for r in rows if len(r) == 5 and r[2] in shells] == []
    assert not JobWorker.objects.filter(job=job, pid__isnull=False).exists()


def test_a_script_linking_outside_the_home_is_rejected(
    jobs_pod, django_capture_on_commit_callbacks
):
    for host in jobs_pod.hosts:
        sh(jobs_pod, host, f"ln -sfn /etc/hostname {jobs_pod.home}/train.py")
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="train.py")
    job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.REJECTED and "outside" in job.reason, job.reason


def test_a_chip_held_outside_the_portal_blocks_the_job_and_names_the_holder(
    jobs_pod, django_capture_on_commit_callbacks
):
    host = jobs_pod.hosts[0]
    sh(jobs_pod, host, "id ann >/dev/null 2>&1 || useradd -m -u 43999 ann")
    sh(jobs_pod, host, "setpriv --reuid=ann --regid=ann --init-groups -- sh -c "
       "'exec 3</dev/accel1; exec sleep 300' >/dev/null 2>&1 &")  # fmt: skip
    try:
        job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
        job_engine.advance(jobs_pod.vm.pk)
        job.refresh_from_db()
        jobs_pod.vm.refresh_from_db()
        assert job.state == JobState.BLOCKED, job.reason
        assert "in use outside the portal" in job.reason and "user=ann" in job.reason
        [holder] = jobs_pod.vm.outside_holders
        assert (holder["worker"], holder["device"], holder["user"]) == (0, "/dev/accel1", "ann")
        assert holder["command"] == "sleep 300"
        # The usage look (job-status.sh with the chips) names the same process.
        [again] = job_engine.check_usage(jobs_pod.vm.pk)
        assert (again["worker"], again["device"], again["user"]) == (0, "/dev/accel1", "ann")
    finally:
        sh(jobs_pod, host, "pkill -KILL -u ann || true")
    # Once the chip is free, the next pass runs it.
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    jobs_pod.vm.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and jobs_pod.vm.outside_holders == []


# --- a pre-flight that cannot hang --------------------------------------------------------


def processes(pod, host) -> list[str]:  # noqa: F811
    """Every live process on a worker as ``user args``, without the look itself and
    without sshd's own or the portal's kept shells (``live_processes``)."""
    return live_processes(sh(pod, host, PS))


def settled(pod, host, before: list[str], timeout: float = 15.0) -> list[str]:  # noqa: F811
    """The worker's processes once they are ``before`` again, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = processes(pod, host)
        if now == before or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def fake_python(pod, name: str, text: str) -> str:  # noqa: F811
    """A venv in milo's home on every worker whose ``python`` is ``text`` (a script)."""
    venv = f"{pod.home}/{name}"
    for host in pod.hosts:
        sh(pod, host, f"mkdir -p {venv}/bin && cat > {venv}/bin/python && chmod 755 "
           f"{venv}/bin/python && chown -R {pod.user}: {venv}", input=text.encode())  # fmt: skip
    return f"~/{name}"


VERSIONS = "python=3.11.0 jax=0.4.30 jaxlib=0.4.30 libtpu=none requests=none libtpu_pin=none"
# Starts a child in a session of its own that keeps the output it was given, then
# answers: the pre-flight used to wait on that output until the child ended.
ESCAPING = f"""#!/bin/sh
case "$*" in *importlib*) setsid sleep 300 2>/dev/null & echo "{VERSIONS}"; exit 0 ;; esac
exec /usr/bin/python3 "$@"
"""
# Never answers, and leaves a child behind as well.
SILENT = """#!/bin/sh
setsid sleep 300 &
exec sleep 300
"""


def test_a_python_whose_child_keeps_its_output_does_not_hold_the_job_or_the_workers(
    jobs_pod, django_capture_on_commit_callbacks
):
    before = [processes(jobs_pod, h) for h in jobs_pod.hosts]
    python = fake_python(jobs_pod, "escaping", ESCAPING)
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"],
                 python=python)  # fmt: skip
    began = time.monotonic()
    job_engine.advance(jobs_pod.vm.pk)
    assert time.monotonic() - began < 15
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.SUCCEEDED, job.reason
    assert ["python", "ok", VERSIONS] in job.preflight["3"]
    for host, seen in zip(jobs_pod.hosts, before, strict=True):
        assert settled(jobs_pod, host, seen) == seen


def test_a_python_that_never_answers_rejects_the_job_naming_it_and_the_next_job_runs(
    jobs_pod, django_capture_on_commit_callbacks, settings
):
    settings.PORTAL_JOB_PREFLIGHT_PROBE_SECONDS = 2
    before = [processes(jobs_pod, h) for h in jobs_pod.hosts]
    python = fake_python(jobs_pod, "silent", SILENT)
    stuck = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"],
                   python=python)  # fmt: skip
    after = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
    began = time.monotonic()
    report = job_engine.advance(jobs_pod.vm.pk)
    took = time.monotonic() - began
    stuck.refresh_from_db()
    assert stuck.state == JobState.REJECTED and took < 15, (stuck.state, took)
    detail = f"{jobs_pod.home}/silent/bin/python did not answer within 2 s"
    # The same refusal on every worker is said once.
    assert stuck.reason == f"The pre-flight failed on every worker (4): python: {detail}."
    for index in range(4):
        assert ["python", "fail", detail] in stuck.preflight[str(index)]
    # The next person's job did not wait for it: it started in the same pass.
    assert report.started == [after.pk]
    after = drive(jobs_pod.vm, after, lambda j: j.has_ended, timeout=30)
    assert after.state == JobState.SUCCEEDED, after.reason
    for host, seen in zip(jobs_pod.hosts, before, strict=True):
        assert settled(jobs_pod, host, seen) == seen


@pytest.mark.slow
def test_a_pre_flight_that_outlasts_the_script_timeout_rejects_the_job_and_leaves_nothing(
    jobs_pod, django_capture_on_commit_callbacks, settings
):
    settings.PORTAL_JOB_PREFLIGHT_PROBE_SECONDS = 6
    settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 2
    before = [processes(jobs_pod, h) for h in jobs_pod.hosts]
    python = fake_python(jobs_pod, "silent", SILENT)
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"],
                 python=python)  # fmt: skip
    job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.REJECTED, job.reason
    assert job.reason == (
        "The pre-flight failed on every worker (4): preflight: it did not finish within 2 s."
    )
    assert job.preflight["0"] == [["preflight", "fail", "it did not finish within 2 s"]]
    # The workers' side ends by itself once its probe is stopped: no root shell, no
    # child of the person's code is left.
    for host, seen in zip(jobs_pod.hosts, before, strict=True):
        assert settled(jobs_pod, host, seen, timeout=20) == seen


def test_a_cancel_while_the_workers_run_the_checks_ends_the_job_before_it_starts(
    jobs_pod, django_capture_on_commit_callbacks, monkeypatch
):
    before = [processes(jobs_pod, h) for h in jobs_pod.hosts]
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
    after = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
    answered = []
    begin = job_engine._Hosts.begin

    def cancel_meanwhile(self, *args, **kwargs):
        held = begin(self, *args, **kwargs)
        if not answered:  # the first job's checks: its owner cancels now
            with django_capture_on_commit_callbacks(execute=False):
                answered.append(jobs.cancel_job(job, jobs_pod.milo).state)
        return held

    monkeypatch.setattr(job_engine._Hosts, "begin", cancel_meanwhile)
    report = job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert answered == [JobState.CANCELLING]  # what the page and the API say meanwhile
    assert job.state == JobState.CANCELLED and job.started_at is None, job.reason
    assert job.reason == "Cancelled before it started." and job.preflight["0"]
    assert set(job.parts.values_list("state", flat=True)) == {"not_started"}
    for host in jobs_pod.hosts:
        assert job.host_id not in sh(jobs_pod, host, "ls /var/lib/tpu-portal/jobs/ || true")
    assert report.started == [after.pk]
    drive(jobs_pod.vm, after, lambda j: j.has_ended, timeout=30)
    for host, seen in zip(jobs_pod.hosts, before, strict=True):
        assert settled(jobs_pod, host, seen) == seen


# Answers, but only after a while: a pre-flight still running when the cancel comes.
SLOW = f"""#!/bin/sh
case "$*" in *importlib*) sleep 6; echo "{VERSIONS}"; exit 0 ;; esac
exec /usr/bin/python3 "$@"
"""


def test_a_cancel_while_the_workers_still_check_stops_the_pass_waiting_for_them(
    jobs_pod, django_capture_on_commit_callbacks, monkeypatch
):
    from tpus.remote import fanout

    before = [processes(jobs_pod, h) for h in jobs_pod.hosts]
    python = fake_python(jobs_pod, "slow", SLOW)
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"],
                 python=python)  # fmt: skip
    after = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
    real_wait, answered = fanout.wait, []

    def wait(futures, timeout=None):
        if not answered:  # the workers are in their checks: the owner cancels now
            with django_capture_on_commit_callbacks(execute=False):
                answered.append(jobs.cancel_job(job, jobs_pod.milo).state)
        return real_wait(futures, timeout=timeout)

    monkeypatch.setattr(fanout, "wait", wait)
    began = time.monotonic()
    report = job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert answered == [JobState.CANCELLING]
    assert job.state == JobState.CANCELLED and job.reason == "Cancelled before it started."
    # The pass did not wait for the slow checks (6 s) to end it, and the next job in
    # line started in the same pass, over new connections.
    assert report.ended[0] == job.pk and report.started == [after.pk]
    assert time.monotonic() - began < 5
    for host in jobs_pod.hosts:
        assert job.host_id not in sh(jobs_pod, host, "ls /var/lib/tpu-portal/jobs/ || true")
    drive(jobs_pod.vm, after, lambda j: j.has_ended, timeout=30)
    # The cut-off pre-flights end by themselves once their probe is done.
    for host, seen in zip(jobs_pod.hosts, before, strict=True):
        assert settled(jobs_pod, host, seen, timeout=20) == seen


@pytest.mark.django_db(transaction=True)
def test_a_cancel_from_another_process_during_the_checks_ends_the_job_within_a_second(
    jobs_pod, django_capture_on_commit_callbacks, monkeypatch
):
    """The pass runs in its own thread (a Celery worker), the cancel comes from the
    page's request meanwhile: the job is cancelling at once and cancelled about a
    second later, without waiting for the workers' slow checks."""
    import threading

    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    from tpus import queue

    # Outside a test transaction the queued pass would run at the submit's commit: the
    # thread below is the only pass.
    monkeypatch.setattr(queue, "advance_jobs", lambda vm_id: None)
    python = fake_python(jobs_pod, "slow", SLOW)
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"],
                 python=python)  # fmt: skip
    reports = []

    def pass_() -> None:
        try:
            reports.append(job_engine.advance(jobs_pod.vm.pk))
        except Exception as exc:  # shown by the assertions below
            reports.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=pass_)
    thread.start()
    deadline = time.monotonic() + 30
    while Job.objects.get(pk=job.pk).state != JobState.VALIDATING:
        assert time.monotonic() < deadline, (reports, Job.objects.get(pk=job.pk).reason)
        time.sleep(0.05)
    with django_capture_on_commit_callbacks(execute=False):
        assert jobs.cancel_job(job, jobs_pod.milo).state == JobState.CANCELLING
    asked = time.monotonic()
    while not Job.objects.get(pk=job.pk).has_ended:
        assert time.monotonic() - asked < 4, "the cancel waited for the checks"
        time.sleep(0.05)
    thread.join(timeout=30)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and job.started_at is None
    assert reports and reports[0].ended == [job.pk]


# --- before anything is queued ----------------------------------------------------------


def test_bad_input_is_refused_with_the_field_and_nothing_is_stored(
    jobs_pod, django_capture_on_commit_callbacks
):
    cases = {
        "env": spec(env=[("TPU_VISIBLE_CHIPS", "0")]),
        "script": spec(script="../other/train.py"),
        "python": spec(python="/opt/venv"),
        "args": spec(script="", args=[]),
        "time_limit_minutes": spec(time_limit_minutes=0),
    }
    for field_name, bad in cases.items():
        with pytest.raises(ValidationError) as caught:
            jobs.submit_job(jobs_pod.milo, jobs_pod.vm, bad)
        assert field_name in caught.value.message_dict, (field_name, caught.value)
    with pytest.raises(PermissionDenied):
        jobs.submit_job(jobs_pod.admin, jobs_pod.vm, spec())  # no grant of his own
    assert not Job.objects.exists()


def test_the_lab_limits_waiting_jobs_per_person(jobs_pod, django_capture_on_commit_callbacks):
    jobs_pod.lab.max_queued_jobs = 2
    jobs_pod.lab.save()
    submit(jobs_pod, django_capture_on_commit_callbacks)
    submit(jobs_pod, django_capture_on_commit_callbacks)
    with pytest.raises(ValidationError, match="allows 2"):
        submit(jobs_pod, django_capture_on_commit_callbacks)
    assert Job.objects.count() == 2


def test_the_portals_own_job_holding_a_chip_is_not_outside_the_portal(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(
        jobs_pod, django_capture_on_commit_callbacks, script="",
        args=["sh", "-c", "exec 3</dev/accel0; echo holding; exec sleep 300"],
    )  # fmt: skip
    job = drive(jobs_pod.vm, job, lambda j: all("holding" in t for t in logs(j)))
    assert job_engine.check_usage(jobs_pod.vm.pk) == []
    jobs_pod.vm.refresh_from_db()
    assert jobs_pod.vm.outside_holders == [] and jobs_pod.vm.usage_checked_at
    with django_capture_on_commit_callbacks(execute=False):
        jobs.cancel_job(job, jobs_pod.milo)
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.CANCELLED


def test_a_job_past_its_time_limit_is_stopped_and_failed(
    jobs_pod, django_capture_on_commit_callbacks
):
    job = submit(
        jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"],
        time_limit_minutes=1,
    )  # fmt: skip
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    # A minute later, as the poll would see it.
    Job.objects.filter(pk=job.pk).update(started_at=job.started_at - dt.timedelta(minutes=2))
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.FAILED and "time limit of 1 minute" in job.reason
    assert all(p.state == "ended" and p.signal for p in job.parts.all())


def test_a_pass_that_died_mid_way_is_finished_by_the_next(
    jobs_pod, django_capture_on_commit_callbacks
):
    # Died while validating: the job is back in line and runs.
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["true"])
    Job.objects.filter(pk=job.pk).update(state=JobState.VALIDATING)
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=60)
    assert job.state == JobState.SUCCEEDED, job.reason

    # Died after starting it on every worker but before recording it as running: the
    # next pass finds every worker running it.
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    Job.objects.filter(pk=job.pk).update(state=JobState.STARTING)
    job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    with django_capture_on_commit_callbacks(execute=False):
        jobs.cancel_job(job, jobs_pod.milo)
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.CANCELLED


def test_a_pass_held_by_another_process_is_not_run_twice(jobs_pod):
    from django.utils import timezone

    TpuVm.objects.filter(pk=jobs_pod.vm.pk).update(
        jobs_claimed_until=timezone.now() + dt.timedelta(seconds=30)
    )
    assert job_engine.advance(jobs_pod.vm.pk).busy


def test_a_pass_turned_away_has_the_holder_pass_again_once_when_it_ends(
    jobs_pod, queued_tasks, django_capture_on_commit_callbacks
):
    # A job submitted while another pass holds the VM starts when that pass ends, not
    # at the next poll: the pass its submit queued was turned away.
    from django.utils import timezone

    vm_id = jobs_pod.vm.pk
    TpuVm.objects.filter(pk=vm_id).update(
        jobs_claimed_until=timezone.now() + dt.timedelta(seconds=30)
    )
    assert job_engine.advance(vm_id).busy
    assert queued_tasks.take("tpus.tasks.advance_jobs") == []

    with django_capture_on_commit_callbacks(execute=True):
        job_engine._release(vm_id)  # the holder's pass ends

    assert queued_tasks.take("tpus.tasks.advance_jobs") == [((vm_id,), None)]
    with django_capture_on_commit_callbacks(execute=True):
        job_engine._release(vm_id)
    assert queued_tasks.take("tpus.tasks.advance_jobs") == []
    # A pass that got the VM has seen everything: nobody asks for another after it.
    TpuVm.objects.filter(pk=vm_id).update(jobs_pass_wanted=True)
    with django_capture_on_commit_callbacks(execute=True):
        job_engine.advance(vm_id)
    assert queued_tasks.take("tpus.tasks.advance_jobs") == []


@pytest.mark.django_db(transaction=True)
def test_two_submissions_racing_for_one_vm_one_runs_and_one_waits(
    jobs_pod, django_capture_on_commit_callbacks
):
    """Two people's passes at the same moment (two Celery workers): the VM's claim lets
    one pass in, and the database refuses a second job holding the VM's place."""
    import threading

    from django.db import IntegrityError, connection, transaction

    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    first = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    second = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    reports, gate = [], threading.Barrier(2)

    def pass_() -> None:
        gate.wait()
        try:
            reports.append(job_engine.advance(jobs_pod.vm.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=pass_) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    first.refresh_from_db()
    second.refresh_from_db()
    assert sorted(r.busy for r in reports) == [False, True]
    assert (first.state, second.state) == (JobState.RUNNING, JobState.QUEUED)
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=second.pk).update(state=JobState.STARTING)
    with django_capture_on_commit_callbacks(execute=False):
        jobs.cancel_job(first, jobs_pod.milo)
        jobs.cancel_job(second, jobs_pod.milo)
    drive(jobs_pod.vm, first, lambda j: j.has_ended, timeout=30)


def test_a_vm_that_is_no_longer_listed_loses_its_running_job_and_frees_the_queue(
    jobs_pod, django_capture_on_commit_callbacks
):
    from django.utils import timezone

    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sleep", "300"])
    job = drive(jobs_pod.vm, job, lambda j: j.state == JobState.RUNNING)
    TpuVm.objects.filter(pk=jobs_pod.vm.pk).update(missing_since=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.LOST and "no longer listed" in job.reason
    TpuVm.objects.filter(pk=jobs_pod.vm.pk).update(missing_since=None)

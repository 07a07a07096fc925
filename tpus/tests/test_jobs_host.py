"""The job scripts on real sshd hosts of the test fleet, through the remote door, with
real JAX (the CPU build ``bin/setup test`` installs where the hosts see it) as the job:
a 4-worker pod whose processes run a collective together, pre-flight refusals, cancel,
a worker killed mid-run, a reboot mid-run, and one status exec per worker."""

from __future__ import annotations

import itertools
import os
import secrets
import time
from pathlib import Path

import pytest

from tests.requirements import need
from tpus.remote import HostKeyPins, Worker, run_on_workers, run_script, site_login
from tpus.remote.jobs import (
    Pod,
    Preflight,
    StartJob,
    differing_scripts,
    encode_cancel,
    encode_preflight,
    encode_start,
    encode_status,
    judge_versions,
    parse_cancel,
    parse_preflight,
    parse_start,
    parse_status,
)
from tpus.remote.kept import kept

pytestmark = pytest.mark.fleet

JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
PORT = 8476
_uids = itertools.count(42000)

POD_PY = """\
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

jax.distributed.initialize(
    coordinator_address=os.environ["TPU_PORTAL_COORDINATOR"],
    num_processes=int(os.environ["TPU_PORTAL_NUM_PROCESSES"]),
    process_id=int(os.environ["TPU_PORTAL_PROCESS_ID"]),
)
n = jax.device_count()
# Each host is its own "slice" to JAX, so make_mesh refuses: build the mesh by hand.
mesh = Mesh(np.array(jax.devices()), ("x",))
values = np.arange(n, dtype=np.float32)
x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")), lambda i: values[i])
total = float(jax.jit(jnp.sum)(x))
print(f"process {jax.process_index()} devices {n} sum {total}", flush=True)
if sys.argv[1:] == ["stay"]:
    print("staying", flush=True)
    time.sleep(600)
"""


class Workers:
    """Fleet hosts as a TPU VM's workers, with a collaborator account on each."""

    def __init__(self, fleet, hosts, username: str):
        self.fleet = fleet
        self.hosts = hosts
        self.user = username
        self.uid = next(_uids)
        self.workers = [
            Worker(
                h.ip, HostKeyPins.parse(fleet.host_keys(h.name)), name=h.name, login=site_login()
            )
            for h in hosts
        ]
        for host in hosts:
            fleet.exec(host.name, ["useradd", "-m", "-u", str(self.uid), "-s", "/bin/sh", username])
        self.home = f"/home/{username}"

    def sh(self, index: int, script: str, *, input: bytes | None = None, check=True) -> str:
        done = self.fleet.exec(
            self.hosts[index].name, ["sh", "-c", script], input=input, check=check
        )
        return done.stdout.decode()

    def put(self, index: int, name: str, text: str) -> str:
        path = f"{self.home}/{name}"
        self.sh(index, f"cat > {path} && chown {self.user}: {path}", input=text.encode())
        return path

    def preflight(self, **options):
        def data(worker):
            index = self.workers.index(worker)
            return encode_preflight(
                Preflight(
                    user=self.user, chips=4, device_glob="/dev/accel*", min_disk_mb=10,
                    min_mem_mb=10, python=JAX_ENV,
                    coordinator_port=PORT if index == 0 else None, **options,
                )
            )  # fmt: skip

        outcomes = run_on_workers(self.workers, "job-preflight.sh", data)
        assert all(o.ok for o in outcomes), [str(o.error) for o in outcomes]
        return {o.worker.name: parse_preflight(o.result.all("check")) for o in outcomes}

    def preflight_with(self, python: str):
        """The pre-flight with another Python environment, on every worker."""
        data = encode_preflight(
            Preflight(user=self.user, chips=4, device_glob="/dev/accel*", min_disk_mb=1,
                      min_mem_mb=1, python=python)
        )  # fmt: skip
        outcomes = run_on_workers(self.workers, "job-preflight.sh", data)
        assert all(o.ok for o in outcomes), [str(o.error) for o in outcomes]
        return {o.worker.name: parse_preflight(o.result.all("check")) for o in outcomes}

    def start(self, job_id: str, argv: list[str], *, count: int | None = None, env=()):
        chosen = self.workers[: count or len(self.workers)]
        coordinator = f"{self.hosts[0].ip}:{PORT}"

        def data(worker):
            index = chosen.index(worker)
            return encode_start(
                StartJob(
                    job_id=job_id, user=self.user, argv=tuple(argv), python=JAX_ENV,
                    env=(("XLA_FLAGS", "--xla_force_host_platform_device_count=4"), *env),
                    pod=Pod(coordinator, len(chosen), index),
                )
            )  # fmt: skip

        outcomes = run_on_workers(chosen, "job-start.sh", data)
        assert all(o.ok for o in outcomes), [str(o.error) for o in outcomes]
        return [parse_start(o.result.values) for o in outcomes]

    def status(self, offsets: dict[str, int], count: int | None = None):
        chosen = self.workers[: count or len(self.workers)]
        outcomes = run_on_workers(chosen, "job-status.sh", encode_status(offsets))
        assert all(o.ok for o in outcomes), [str(o.error) for o in outcomes]
        return [parse_status(o.result.pairs) for o in outcomes]

    def cancel(self, index: int, job_id: str, grace: int = 2):
        result = run_script(self.workers[index], "job-cancel.sh", encode_cancel(job_id, grace))
        return parse_cancel(result.values)

    def wait_for(self, job_id: str, predicate, count=None, timeout=90.0):
        deadline = time.monotonic() + timeout
        while True:
            reports = self.status({job_id: 0}, count)
            states = [r.jobs[job_id] for r in reports]
            if predicate(states) or time.monotonic() > deadline:
                return states
            time.sleep(0.2)

    def group_members(self, index: int, pgid: int) -> list[str]:
        out = self.sh(index, "ps -e -o pgid=,stat=,args=")
        return [
            ln for ln in out.splitlines() if ln.split()[0] == str(pgid) and ln.split()[1][0] != "Z"
        ]


def new_job_id() -> str:
    return f"t{secrets.token_hex(5)}"


@pytest.fixture
def jax_env():
    need(
        Path(JAX_ENV, "bin", "python").exists(),
        f"JAX's CPU build is not in {JAX_ENV} (bin/setup test)",
    )
    return JAX_ENV


@pytest.fixture
def pod(fleet, fleet_settings, fleet_hosts, fleet_username, jax_env):
    workers = Workers(fleet, fleet_hosts(4), fleet_username)
    for index in range(4):
        workers.put(index, "pod.py", POD_PY)
    return workers


def python_argv(workers: Workers, *args: str) -> list[str]:
    return [f"{JAX_ENV}/bin/python", "-u", f"{workers.home}/pod.py", *args]


# --- a pod ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_four_worker_pod_runs_one_collective_over_sixteen_devices(pod):
    started = time.monotonic()
    reports = pod.preflight(script=f"{pod.home}/pod.py", env_names=("XLA_FLAGS",))
    answers = pod.start(job_id := new_job_id(), python_argv(pod))
    running = time.monotonic() - started
    print(f"\nsubmit -> running on 4 workers (pre-flight + start): {running:.2f} s")

    assert all(r.ok for r in reports.values()), {n: r.failures for n, r in reports.items()}
    assert differing_scripts(reports) == []
    versions = next(iter(reports.values())).versions
    assert versions["jax"] == "0.10.2" and judge_versions(versions, need_libtpu=False) == []
    assert [a.outcome for a in answers] == ["started"] * 4

    states = pod.wait_for(job_id, lambda s: all(j.state == "ended" for j in s))
    logs = [j.log.decode(errors="replace") for j in states]
    assert [j.exit_status for j in states] == [0, 0, 0, 0], logs
    for index, log in enumerate(logs):
        assert f"process {index} devices 16 sum 120.0" in log, log
    began = time.monotonic()
    pod.status({job_id: 0})
    print(f"status round on 4 workers: {time.monotonic() - began:.3f} s")


# --- pre-flight -----------------------------------------------------------------------


def test_preflight_refuses_a_chip_held_by_another_users_process_and_names_it(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    other = f"{fleet_username}o"
    fleet.exec(fleet_host.name, ["useradd", "-m", "-u", str(next(_uids)), other])
    workers.sh(0, f"setpriv --reuid={other} --regid={other} --init-groups -- sh -c "
               "'exec 3</dev/accel2; exec sleep 300' >/dev/null 2>&1 & echo $!")  # fmt: skip
    try:
        report = workers.preflight()[fleet_host.name]
        holders = [c for c in report.checks if c.name == "chip_holder"]
        assert len(holders) == 1 and holders[0].status == "fail"
        assert "/dev/accel2" in holders[0].detail and f"user={other}" in holders[0].detail
        assert "command=sleep 300" in holders[0].detail
        assert report.detail("chips").startswith("4 of 4")
    finally:
        workers.sh(0, f"pkill -KILL -u {other} || true")


def test_preflight_removes_a_stale_libtpu_lockfile_and_refuses_a_held_one(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    workers.sh(0, "touch /tmp/libtpu_lockfile && chmod 600 /tmp/libtpu_lockfile")
    report = workers.preflight()[fleet_host.name]
    check = next(c for c in report.checks if c.name == "libtpu_lockfile")
    assert check.status == "note" and "removed a stale" in check.detail
    # (Only the lockfile: the host's /tmp is shared with the session's other tests.)
    assert "libtpu_lockfile" not in workers.sh(0, "ls /tmp")

    holder = (
        "import fcntl, os, time\n"
        "fd = os.open('/tmp/libtpu_lockfile', os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('held', flush=True)\n"
        "time.sleep(300)\n"
    )
    path = workers.put(0, "hold.py", holder)
    workers.sh(0, f"setpriv --reuid={workers.user} --regid={workers.user} --init-groups -- "
               f"python3 {path} > /tmp/held.out 2>&1 &")  # fmt: skip
    try:
        for _ in range(100):
            if "held" in workers.sh(0, "cat /tmp/held.out"):
                break
            time.sleep(0.05)
        report = workers.preflight()[fleet_host.name]
        check = next(c for c in report.checks if c.name == "libtpu_lockfile")
        assert check.status == "fail", check
        assert f"user={workers.user}" in check.detail and "hold.py" in check.detail
        assert "libtpu_lockfile" in workers.sh(0, "ls /tmp")
    finally:
        workers.sh(0, f"pkill -KILL -u {workers.user} || true")


def _portal_lock(workers: Workers):
    report = workers.preflight()[workers.hosts[0].name]
    return next(c for c in report.checks if c.name == "portal_lock")


def test_preflight_sees_a_running_jobs_lock_and_not_a_holder_file_left_behind(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    assert _portal_lock(workers).status == "ok"
    job_id = new_job_id()
    [answer] = workers.start(job_id, ["sleep", "300"])
    assert answer.outcome == "started"
    try:
        check = _portal_lock(workers)
        assert check.status == "fail" and f"job {job_id} holds this TPU" in check.detail
    finally:
        workers.cancel(0, job_id, grace=1)
    workers.wait_for(job_id, lambda states: states[0].state == "ended")
    assert _portal_lock(workers).status == "ok"
    # A holder file a killed supervisor left: the lock is free, and the check says so.
    workers.sh(0, "echo t0000000000 >/run/tpu-portal/holder")
    try:
        assert _portal_lock(workers).status == "ok"
    finally:
        workers.sh(0, "rm -f /run/tpu-portal/holder")


def test_the_supervisors_script_is_written_once_a_boot_and_again_when_missing(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    look = "stat -c '%i %Y' /run/tpu-portal/supervise-*.sh"

    def start_and_end() -> None:
        job_id = new_job_id()
        [answer] = workers.start(job_id, ["true"])
        assert answer.outcome == "started"
        workers.wait_for(job_id, lambda states: states[0].state == "ended")

    start_and_end()
    first = workers.sh(0, look)
    start_and_end()
    assert workers.sh(0, look) == first  # the same file, not written again
    workers.sh(0, "rm -f /run/tpu-portal/supervise-*.sh")
    start_and_end()
    assert workers.sh(0, look).count("\n") == 1
    assert workers.sh(0, "ls -a /run/tpu-portal | grep -c supervise || true").strip() == "1"


def test_preflight_names_the_worker_whose_script_differs(
    fleet, fleet_settings, fleet_hosts, fleet_username, jax_env
):
    hosts = fleet_hosts(3)
    workers = Workers(fleet, hosts, fleet_username)
    for index in range(3):
        workers.put(index, "train.py", "print('v1')\n" if index != 1 else "print('v2')\n")
    reports = workers.preflight(script=f"{workers.home}/train.py")
    assert all(r.ok for r in reports.values())
    assert differing_scripts(reports) == [hosts[1].name]


def test_preflight_refuses_a_script_that_links_outside_the_home(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    workers.sh(0, f"ln -s /etc/hostname {workers.home}/train.py")
    report = workers.preflight(script=f"{workers.home}/train.py")[fleet_host.name]
    check = next(c for c in report.checks if c.name == "script")
    assert check.status == "fail" and "outside" in check.detail and "/etc/hostname" in check.detail


# A venv "python" that starts a child in a session of its own holding the output it
# was given, then answers (or never answers): the pre-flight used to wait on that pipe
# until the child ended, as root, on every worker.
ESCAPING_PYTHON = """#!/bin/sh
setsid sleep 300 2>/dev/null &
echo "python=3.11.0 jax=0.4.30 jaxlib=0.4.30 libtpu=none requests=none libtpu_pin=none"
"""
SILENT_PYTHON = """#!/bin/sh
setsid sleep 300 &
exec sleep 300
"""


def processes(workers: Workers, index: int) -> list[str]:
    """Every live process on a worker as ``user args``, without the look itself and
    without sshd's own."""
    return live_processes(workers.sh(index, PS))


PS = "ps -e -o stat=,pid=,ppid=,user=,args="


def live_processes(out: str) -> list[str]:
    """``PS``'s answer as sorted ``user args``: no zombie, not the look itself, not
    sshd's own (the listener's title counts connections being made; a session goes a
    moment after its connection) and not the kept shells of the portal's connections
    (a sudo and its shell, ``tpus/remote/ssh.py``): what counts is what ran under them."""
    rows = [r for r in (line.split(None, 4) for line in out.splitlines()) if len(r) == 5]
    kept_sudo = {
        r[1] for r in rows if r[4].startswith("sudo ") and r[4].endswith(" tpu-portal-shell")
    }
    kept = kept_sudo | {
        r[1] for r in rows if r[2] in kept_sudo and r[4].endswith(" tpu-portal-shell")
    }
    return sorted(
        f"{r[3]} {r[4]}"
        for r in rows
        if not r[0].startswith("Z")
        and PS not in r[4]
        and r[4].split()[:1] != ["sshd:"]
        and r[1] not in kept
    )


def settled(workers: Workers, index: int, before: list[str], timeout: float = 10.0) -> list[str]:
    """The worker's processes once they are ``before`` again (or the timeout passed):
    an SSH session's processes take a moment to go after the connection closes."""
    deadline = time.monotonic() + timeout
    while True:
        now = processes(workers, index)
        if now == before or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def fake_env(workers: Workers, name: str, text: str) -> str:
    venv = f"{workers.home}/{name}"
    for index in range(len(workers.hosts)):
        workers.sh(index, f"mkdir -p {venv}/bin && cat > {venv}/bin/python && "
                   f"chmod 755 {venv}/bin/python && chown -R {workers.user}: {venv}",
                   input=text.encode())  # fmt: skip
    return venv


def test_a_python_whose_child_keeps_its_output_cannot_hold_the_preflight(
    fleet, fleet_settings, fleet_hosts, fleet_username
):
    workers = Workers(fleet, fleet_hosts(2), fleet_username)
    venv = fake_env(workers, "escaping", ESCAPING_PYTHON)
    before = [processes(workers, i) for i in range(2)]
    began = time.monotonic()
    reports = workers.preflight_with(python=venv)
    took = time.monotonic() - began
    assert took < 10, took
    for report in reports.values():
        assert report.detail("python").startswith("python=3.11.0 jax=0.4.30"), report.checks
    # Nothing is left: no root shell waiting on a pipe, no child of the person's code.
    for index in range(2):
        assert settled(workers, index, before[index]) == before[index]


def test_a_python_that_never_answers_fails_its_check_in_time_and_leaves_nothing(
    fleet, fleet_settings, fleet_hosts, fleet_username
):
    workers = Workers(fleet, fleet_hosts(2), fleet_username)
    venv = fake_env(workers, "silent", SILENT_PYTHON)
    before = [processes(workers, i) for i in range(2)]
    data = encode_preflight(
        Preflight(user=workers.user, chips=4, device_glob="/dev/accel*", min_disk_mb=1,
                  min_mem_mb=1, python=venv, probe_seconds=2)
    )  # fmt: skip
    began = time.monotonic()
    outcomes = run_on_workers(workers.workers, "job-preflight.sh", data)
    took = time.monotonic() - began
    assert all(o.ok for o in outcomes), [str(o.error) for o in outcomes]
    assert took < 2 + 2 + 3, took  # the probe's time, KILL's delay, the rest
    for outcome in outcomes:
        report = parse_preflight(outcome.result.all("check"))
        check = next(c for c in report.checks if c.name == "python")
        assert (check.status, check.detail) == (
            "fail", f"{venv}/bin/python did not answer within 2 s"
        )  # fmt: skip
    for index in range(2):
        assert settled(workers, index, before[index]) == before[index]


def test_check_details_keep_their_apostrophes(fleet, fleet_settings, fleet_host, fleet_username):
    workers = Workers(fleet, [fleet_host], fleet_username)
    workers.sh(0, f"ln -s /etc/hostname {workers.home}/train.py")
    report = workers.preflight(script=f"{workers.home}/train.py")[fleet_host.name]
    assert f"outside {workers.user}'s home" in report.detail("script")


def test_the_host_refuses_forbidden_environment_names_the_encoder_would_never_send(
    fleet, fleet_settings, fleet_host, fleet_username, jax_env
):
    workers = Workers(fleet, [fleet_host], fleet_username)
    data = encode_preflight(
        Preflight(user=workers.user, chips=4, device_glob="/dev/accel*", min_disk_mb=1,
                  min_mem_mb=1, env_names=("XLA_FLAGS",))
    )  # fmt: skip
    data = data.replace(b"end\n", b"env TPU_VISIBLE_CHIPS\nenv LD_LIBRARY_PATH\nend\n")
    result = run_script(workers.workers[0], "job-preflight.sh", data)
    report = parse_preflight(result.all("check"))
    check = next(c for c in report.checks if c.name == "env")
    assert check.status == "fail"
    assert "TPU_VISIBLE_CHIPS" in check.detail and "LD_LIBRARY_PATH" in check.detail


# --- cancel, a killed worker, a reboot --------------------------------------------------


@pytest.mark.slow
def test_cancel_kills_a_jax_job_that_ignores_term_and_frees_the_lock(pod):
    job_id = new_job_id()
    answers = pod.start(job_id, python_argv(pod, "stay"), count=2)
    states = pod.wait_for(job_id, lambda s: all(b"staying" in j.log for j in s), count=2)
    assert all(b"staying" in j.log for j in states), [j.log for j in states]
    assert all(r.lock_holder == job_id for r in pod.status({}, count=2))
    refused = pod.start(new_job_id(), ["true"], count=1)
    assert (refused[0].outcome, refused[0].reason) == ("refused", f"busy {job_id}")

    began = time.monotonic()
    outcomes = run_on_workers(pod.workers[:2], "job-cancel.sh", encode_cancel(job_id, 2))
    print(f"\ncancel on 2 workers in parallel: {time.monotonic() - began:.2f} s")
    results = [parse_cancel(o.result.values) for o in outcomes]
    # JAX's preemption handler catches SIGTERM once jax.distributed is initialized, so
    # the coordinator's process needs the KILL; the other may end once it is gone.
    assert results[0] == ("kill", True)
    assert results[1] in (("kill", True), ("ended", True))
    for index, answer in enumerate(answers):
        assert pod.group_members(index, answer.pid) == []
    reports = pod.status({job_id: 0}, count=2)
    assert all(r.lock_holder is None for r in reports)
    assert reports[0].jobs[job_id].signal == "KILL"
    assert all(r.jobs[job_id].state == "ended" and r.jobs[job_id].cancel_requested for r in reports)
    again = pod.start(new_job_id(), ["true"], count=1)
    assert again[0].outcome == "started"


@pytest.mark.slow
def test_a_worker_whose_process_is_killed_reports_its_signal_while_the_other_runs(pod):
    job_id = new_job_id()
    answers = pod.start(job_id, python_argv(pod, "stay"), count=2)
    pod.wait_for(job_id, lambda s: all(b"staying" in j.log for j in s), count=2)
    pod.sh(1, f"kill -KILL {answers[1].pid}")
    try:
        states = pod.wait_for(job_id, lambda s: s[1].state == "ended", count=2, timeout=10)
        assert (states[1].state, states[1].signal, states[1].exit_status) == ("ended", "KILL", None)
        assert (states[0].state, states[0].process_alive) == ("running", True)
    finally:
        pod.cancel(0, job_id, grace=1)


@pytest.mark.slow
def test_a_reboot_mid_run_changes_the_boot_id_and_the_job_is_lost(pod):
    job_id = new_job_id()
    answers = pod.start(job_id, ["sleep", "300"], count=1)
    before = pod.status({job_id: 0}, count=1)[0]
    assert before.jobs[job_id].state == "running"
    assert before.boot_id == answers[0].boot_id == before.jobs[job_id].boot_id

    pod.fleet.reboot(pod.hosts[0].name)
    after = pod.status({job_id: 0}, count=1)[0]
    assert after.boot_id != before.boot_id
    assert after.jobs[job_id].state == "lost" and not after.jobs[job_id].process_alive
    assert after.lock_holder is None


def runs(pod) -> int:
    """Scripts run on the pod's first worker: execs, and requests to kept shells."""
    return pod.fleet.log(pod.hosts[0].name).count("Starting session: command") + (
        kept.counts.shell_runs - kept.counts.shells
    )


@pytest.mark.slow
def test_one_status_exec_per_worker_returns_every_job_and_log_bytes_by_offset(pod):
    done_id, running_id = new_job_id(), new_job_id()
    pod.start(done_id, ["sh", "-c", "printf 'one\\ntwo\\n'"], count=1)
    pod.wait_for(done_id, lambda s: s[0].state == "ended", count=1)
    pod.start(running_id, ["sh", "-c", "echo alpha; exec sleep 300"], count=1)
    try:
        pod.wait_for(running_id, lambda s: s[0].log_size > 0, count=1)
        # One run: an exec of its own, or a request to the connection's kept shell.
        before = runs(pod)
        report = pod.status({done_id: 4}, count=1)[0]  # the running job comes unasked
        assert runs(pod) == before + 1
        assert report.jobs[done_id].log == b"two\n" and report.jobs[done_id].log_offset == 4
        assert report.jobs[done_id].succeeded
        assert (
            report.jobs[running_id].state == "running" and report.jobs[running_id].log == b"alpha\n"
        )
        assert report.lock_holder == running_id
        assert pod.status({"never-started": 0}, count=1)[0].jobs["never-started"].state == "unknown"
    finally:
        pod.cancel(0, running_id, grace=1)


# --- the test ground ------------------------------------------------------------------


def test_each_host_name_resolves_to_its_own_fleet_address_even_after_a_move(fleet, fleet_hosts):
    first, second = fleet_hosts(2)
    for host in (first, second):
        out = fleet.exec(host.name, ["sh", "-c", "getent hosts $(hostname)"]).stdout.decode()
        assert out.split() == [host.ip, host.hostname]
    new_ip = fleet.move(first.name)
    out = fleet.exec(first.name, ["sh", "-c", "getent hosts $(hostname)"]).stdout.decode()
    assert out.split() == [new_ip, first.hostname]


def test_each_host_has_its_own_fake_chips_and_boot_id(fleet, fleet_hosts):
    first, second = fleet_hosts(2)
    fleet.exec(first.name, ["sh", "-c", "echo held > /dev/shm/mark"])
    seen = [
        fleet.exec(
            h.name, ["sh", "-c", "ls /dev/accel*; ls /dev/shm; cat /proc/sys/kernel/random/boot_id"]
        )
        .stdout.decode()
        .split()
        for h in (first, second)
    ]
    assert seen[0][:4] == seen[1][:4] == [f"/dev/accel{i}" for i in range(4)]
    assert seen[0][4] == "mark" and len(seen[0]) == 6 and len(seen[1]) == 5  # /dev/shm too
    assert seen[0][-1] == first.boot_id != second.boot_id == seen[1][-1]


def test_the_environments_versions_are_read_again_once_a_package_changes(
    fleet, fleet_settings, fleet_host, fleet_username
):
    """The pre-flight keeps what it read of an environment until its packages change:
    a package installed, upgraded or removed is seen by the next pre-flight."""
    workers = Workers(fleet, [fleet_host], fleet_username)
    venv = f"{workers.home}/env"
    workers.sh(0, f"setpriv --reuid={workers.user} --regid={workers.user} --init-groups -- "
               f"/usr/bin/python3 -m venv --without-pip {venv}")  # fmt: skip
    site = workers.sh(0, f"ls -d {venv}/lib/python3*/site-packages").strip()

    def install(name: str, version: str) -> None:
        meta = f"{site}/{name}-{version}.dist-info"
        text = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        workers.sh(0, f"rm -rf {site}/{name}-*.dist-info && mkdir {meta} && "
                   f"cat > {meta}/METADATA && chown -R {workers.user}: {site}",
                   input=text.encode())  # fmt: skip

    def versions() -> str:
        return workers.preflight_with(python=venv)[fleet_host.name].detail("python")

    install("jax", "0.4.1")
    install("jaxlib", "0.4.1")
    assert "jax=0.4.1 jaxlib=0.4.1" in versions()
    assert "jax=0.4.1 jaxlib=0.4.1" in versions()  # kept: nothing changed
    install("jax", "0.4.2")
    assert "jax=0.4.2 jaxlib=0.4.1" in versions()
    workers.sh(0, f"rm -rf {site}/jaxlib-*.dist-info")
    assert "jaxlib=none" in versions()


def test_a_kept_answer_about_an_environment_is_not_used_once_the_person_cannot_run_it(
    fleet, fleet_settings, fleet_host, fleet_username
):
    """The versions kept from an earlier pre-flight stand in for the look at whether the
    person can run the interpreter, until the interpreter or its folder changes: a
    folder the person can no longer enter fails the check again, and opened once more
    the check passes."""
    workers = Workers(fleet, [fleet_host], fleet_username)
    venv = f"{workers.home}/kept-env"
    workers.sh(0, f"setpriv --reuid={workers.user} --regid={workers.user} --init-groups -- "
               f"/usr/bin/python3 -m venv --without-pip {venv}")  # fmt: skip
    site = workers.sh(0, f"ls -d {venv}/lib/python3*/site-packages").strip()
    for name in ("jax", "jaxlib"):
        meta = f"{site}/{name}-0.4.1.dist-info"
        text = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.4.1\n"
        workers.sh(0, f"mkdir {meta} && cat > {meta}/METADATA && chown -R {workers.user}: {site}",
                   input=text.encode())  # fmt: skip

    def python_check():
        report = workers.preflight_with(python=venv)[fleet_host.name]
        return next((c.status, c.detail) for c in report.checks if c.name == "python")

    assert python_check()[0] == "ok"
    assert python_check()[0] == "ok"  # the kept answer
    workers.sh(0, f"chown root: {venv}/bin && chmod 700 {venv}/bin")
    assert python_check() == (
        "fail", f"{venv}/bin/python is not there or {workers.user} cannot run it"
    )  # fmt: skip
    workers.sh(0, f"chmod 755 {venv}/bin")
    assert python_check() == ("ok", python_check()[1])
    assert "jax=0.4.1 jaxlib=0.4.1" in python_check()[1]


def test_job_start_refuses_bad_input_whole_and_starts_nothing(
    fleet, fleet_settings, fleet_host, fleet_username
):
    from tpus.remote import RemoteError

    workers = Workers(fleet, [fleet_host], fleet_username)
    job_id = new_job_id()
    good = encode_start(StartJob(job_id=job_id, user=workers.user, argv=("true",)))
    cases = {
        "cut off": good.replace(b"end\n", b""),
        "no final newline": good[:-1],
        "two jobs": good.replace(b"end\n", b"job other\nend\n"),
        "forbidden name": good.replace(b"end\n", b"env TPU_VISIBLE_CHIPS MA==\nend\n"),
        "no header": good.split(b"\n", 1)[1],
        "no command": b"\n".join(ln for ln in good.split(b"\n") if not ln.startswith(b"arg ")),
    }
    for name, data in cases.items():
        with pytest.raises(RemoteError) as refused:
            run_script(workers.workers[0], "job-start.sh", data)
        assert refused.value.kind == RemoteError.SCRIPT, name
    folder = f"/var/lib/tpu-portal/jobs/{job_id}"
    assert workers.sh(0, f"test -e {folder} && echo there || echo none").strip() == "none"
    assert "start=started" in run_script(workers.workers[0], "job-start.sh", good).stdout

"""A job is its cgroup, on real sshd hosts of the test fleet (each host has cgroups of
its own where a worker has them): whatever a job starts, a process that left its group
with ``setsid`` among them, goes with the job's end and its cancel, and the TPU is free
only once the cgroup is empty; a cancel keeps its grace; the lab's limits on tasks,
memory and the log bite; old folders expire; a folder of an earlier boot is harmless."""

from __future__ import annotations

import datetime as dt
import itertools
import time

import pytest

from tpus.models import Job
from tpus.models.jobs import JobState
from tpus.remote import HostKeyPins, Worker, run_script, site_login
from tpus.remote.jobs import (
    StartJob,
    cancel_emptied,
    encode_cancel,
    encode_start,
    encode_status,
    parse_cancel,
    parse_start,
    parse_status,
)
from tpus.services import job_engine, jobs
from tpus.tests.test_jobs_host import new_job_id
from tpus.tests.test_jobs_service import drive, jax_env, jobs_pod, submit  # noqa: F401
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)

pytestmark = pytest.mark.fleet

JOBS = "/var/lib/tpu-portal/jobs"
_uids = itertools.count(43000)


class Host:
    """One fleet host as a worker, with a collaborator account on it."""

    def __init__(self, fleet, host, username: str):
        self.fleet, self.host, self.user = fleet, host, username
        self.worker = Worker(
            host.ip, HostKeyPins.parse(fleet.host_keys(host.name)), name=host.name,
            login=site_login(),
        )  # fmt: skip
        fleet.exec(host.name, ["useradd", "-m", "-u", str(next(_uids)), "-s", "/bin/sh", username])

    def sh(self, script: str, *, check: bool = True) -> str:
        return self.fleet.exec(self.host.name, ["sh", "-c", script], check=check).stdout.decode()

    def start(self, job_id: str, command: str, **limits):
        data = encode_start(StartJob(job_id=job_id, user=self.user, argv=("sh", "-c", command),
                                     **limits))  # fmt: skip
        return parse_start(run_script(self.worker, "job-start.sh", data).values)

    def status(self, job_id: str):
        result = run_script(self.worker, "job-status.sh", encode_status({job_id: 0}, 1 << 20))
        return parse_status(result.pairs)

    def cancel(self, job_id: str, grace: int):
        result = run_script(self.worker, "job-cancel.sh", encode_cancel(job_id, grace))
        return parse_cancel(result.values), cancel_emptied(result.values)

    def wait_for(self, job_id: str, predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            report = self.status(job_id)
            # Whenever it is looked at, a job read as ended no longer holds the TPU.
            if report.jobs[job_id].state == "ended":
                assert report.lock_holder != job_id, report
            if predicate(report.jobs[job_id]) or time.monotonic() > deadline:
                return report
            time.sleep(0.1)

    def processes(self) -> list[str]:
        """The person's live processes (zombies do not count)."""
        out = self.sh(f"ps -u {self.user} -o stat=,args= || true")
        return [ln for ln in out.splitlines() if ln.strip() and not ln.strip().startswith("Z")]

    def exists(self, path: str) -> bool:
        return self.sh(f"test -e {path} && echo yes || echo no").strip() == "yes"


@pytest.fixture
def host(fleet, fleet_settings, fleet_host, fleet_username):
    worker = Host(fleet, fleet_host, fleet_username)
    yield worker
    worker.sh(f"pkill -KILL -u {fleet_username} || true")


ESCAPE = "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo escaped"


# --- the job's end, its cancel, the lock ------------------------------------------------


def test_the_start_answers_once_the_command_runs_as_the_person_and_no_one_keeps_the_hand_over(
    host,
):
    job = new_job_id()
    answer = host.start(job, "exec sleep 300")
    assert answer.outcome == "started"
    uid = host.sh(f"id -u {host.user}").strip()
    # Read at once after the answer: the ids are the person's already, the process is
    # the command itself (the hand-over's sh execs it), and neither it nor the
    # supervisor holds the hand-over's pipe.
    status = host.sh(f"grep -E '^(Uid|Gid):' /proc/{answer.pid}/status")
    assert [line.split()[1] for line in status.splitlines()] == [uid, uid]
    assert host.sh(f"tr '\\0' ' ' </proc/{answer.pid}/cmdline").strip() == "sleep 300"
    holders = host.sh("ls -l /proc/[0-9]*/fd 2>/dev/null | grep -c switch.pipe || true")
    assert holders.strip() == "0"
    host.cancel(job, 1)
    ended = host.wait_for(job, lambda j: j.state == "ended")
    assert ended.jobs[job].state == "ended"
    assert host.sh(f"ls {JOBS}/{job}").split().count("switch.pipe") == 0


def test_a_command_that_cannot_start_still_gets_its_answer_and_its_end(host):
    job = new_job_id()
    data = encode_start(StartJob(job_id=job, user=host.user, argv=("/nonexistent/program",)))
    answer = parse_start(run_script(host.worker, "job-start.sh", data).values)
    assert answer.outcome == "started"
    ended = host.wait_for(job, lambda j: j.state == "ended")
    assert ended.jobs[job].exit_status == 127


def test_a_process_that_left_its_group_dies_with_the_jobs_end(host):
    job_id = new_job_id()
    answer = host.start(job_id, f"{ESCAPE}; sleep 0.5")
    assert answer.outcome == "started" and answer.cgroup.endswith(f"/tpu-portal/job-{job_id}")
    assert host.exists(answer.cgroup)
    report = host.wait_for(job_id, lambda j: j.state == "ended")
    state = report.jobs[job_id]
    assert state.state == "ended" and state.exit_status == 0, state
    # Ended means: nothing of it runs, its cgroup is gone, and the TPU is free.
    assert host.processes() == []
    assert report.lock_holder is None
    assert not host.exists(answer.cgroup)


def test_a_cancel_kills_what_left_the_group_and_answers_once_the_cgroup_is_empty(host):
    job_id = new_job_id()
    answer = host.start(job_id, f"{ESCAPE}; exec sleep 300")
    host.wait_for(job_id, lambda j: b"escaped" in j.log)
    assert len(host.processes()) == 2
    (how, lock_free), empty = host.cancel(job_id, grace=2)
    assert (how, lock_free, empty) == ("term", True, True)
    assert host.processes() == []
    assert not host.exists(answer.cgroup)
    assert host.status(job_id).jobs[job_id].state == "ended"


def test_a_cancel_of_a_job_that_ignores_term_is_done_at_the_grace(host):
    job_id = new_job_id()
    host.start(job_id, f"trap '' TERM; {ESCAPE}; echo ready; while :; do sleep 1; done")
    host.wait_for(job_id, lambda j: b"ready" in j.log)
    began = time.monotonic()
    (how, lock_free), empty = host.cancel(job_id, grace=2)
    took = time.monotonic() - began
    print(f"\ncancel with a grace of 2 s of a job that ignores TERM: {took:.2f} s")
    assert (how, lock_free, empty) == ("kill", True, True)
    assert host.processes() == []
    # The grace, then KILL at once (not at a next poll), plus one SSH login (~0.3 s).
    assert 2.0 <= took < 3.5


def test_without_cgroup_kill_a_cancel_freezes_the_cgroup_and_kills_every_process(host):
    """Kernels before 5.14 have no cgroup.kill: here it is hidden behind /dev/null."""
    job_id = new_job_id()
    answer = host.start(job_id, f"trap '' TERM; {ESCAPE}; echo ready; while :; do sleep 1; done")
    host.wait_for(job_id, lambda j: b"ready" in j.log)
    host.sh(f"mount --bind /dev/null {answer.cgroup}/cgroup.kill")
    try:
        (how, lock_free), empty = host.cancel(job_id, grace=1)
    finally:
        host.sh(f"umount {answer.cgroup}/cgroup.kill 2>/dev/null || true")
    assert (how, lock_free, empty) == ("kill", True, True)
    assert host.processes() == []
    assert not host.exists(answer.cgroup)


def test_the_next_job_waits_while_processes_of_the_last_outlive_its_supervisor(host):
    first, second = new_job_id(), new_job_id()
    host.start(first, f"{ESCAPE}; exec sleep 300")
    host.wait_for(first, lambda j: b"escaped" in j.log)
    # The supervisor (and with it the lock) dies; the job's processes do not.
    host.sh(f"kill -KILL $(cut -d' ' -f1 {JOBS}/{first}/supervisor)")
    report = host.wait_for(first, lambda j: j.state == "lost")
    assert report.lock_holder is None and len(host.processes()) == 2

    refused = host.start(second, "true")
    assert (refused.outcome, refused.reason) == ("refused", f"busy {first}")
    assert not host.exists(f"{JOBS}/{second}")

    (how, _), empty = host.cancel(first, grace=1)
    assert how == "term" and empty and host.processes() == []
    assert host.start(second, "true").outcome == "started"


def test_a_chip_held_by_what_left_the_jobs_group_is_the_jobs_not_outside_the_portal(host):
    from tpus.services.job_engine import _outside

    job_id = new_job_id()
    answer = host.start(
        job_id, "setsid sh -c 'exec 3</dev/accel1; exec sleep 300' & echo held; exec sleep 300"
    )
    host.wait_for(job_id, lambda j: b"held" in j.log)
    outside = host.sh("sh -c 'exec 3</dev/accel2; exec sleep 302' >/dev/null 2>&1 & echo $!")
    try:
        deadline = time.monotonic() + 10
        while True:
            result = run_script(
                host.worker, "job-status.sh", encode_status({}, 0, device_glob="/dev/accel*")
            )
            holders = {h.device: h for h in parse_status(result.pairs).holders}
            if len(holders) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        mine, other = holders["/dev/accel1"], holders["/dev/accel2"]
        assert mine.job == job_id and mine.pgid != answer.pid and mine.user == host.user
        assert other.job == "" and other.user == "root"
        seen = _outside(0, list(holders.values()), own_group=answer.pid)
        assert [h["device"] for h in seen] == ["/dev/accel2"]
    finally:
        host.sh(f"kill -KILL {outside.strip()} || true")
        host.cancel(job_id, grace=0)


# --- limits ----------------------------------------------------------------------------


FORK = """\
import os, time
n = 0
try:
    while n < 100:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as exc:
    print(f"refused after {n}: {exc.strerror}", flush=True)
time.sleep(60)
"""


def test_a_job_forking_past_its_tasks_limit_is_refused_more(host):
    job_id = new_job_id()
    host.fleet.exec(host.host.name, ["sh", "-c", f"cat > /home/{host.user}/fork.py"],
                    input=FORK.encode())  # fmt: skip
    answer = host.start(job_id, "exec python3 fork.py", tasks_max=32)
    assert answer.tasks_max == 32
    state = host.wait_for(job_id, lambda j: b"refused" in j.log).jobs[job_id]
    assert state.log == b"refused after 31: Resource temporarily unavailable\n", state
    assert state.state == "running" and len(host.processes()) == 32
    host.cancel(job_id, grace=0)
    assert host.processes() == []


def test_a_job_past_its_memory_limit_is_killed(host):
    job_id = new_job_id()
    answer = host.start(
        job_id,
        'echo allocating; exec python3 -c \'b = b"x" * (200 << 20); print("survived")\'',
        memory_max_mb=64,
    )
    assert answer.memory_max == 64 << 20
    report = host.wait_for(job_id, lambda j: j.state == "ended")
    state = report.jobs[job_id]
    assert (state.state, state.signal) == ("ended", "KILL"), state
    assert b"allocating" in state.log and b"survived" not in state.log


def test_the_log_is_cut_at_its_cap_with_a_line_saying_so_and_the_job_runs_on(host):
    job_id = new_job_id()
    host.start(
        job_id,
        "head -c 50000 /dev/zero | tr '\\0' a; echo; echo after the cap; touch $HOME/went-on",
        log_max_bytes=4096,
    )
    state = host.wait_for(job_id, lambda j: j.state == "ended").jobs[job_id]
    assert state.exit_status == 0
    assert host.exists(f"/home/{host.user}/went-on")
    log = state.log
    assert log[:4096] == b"a" * 4096
    last = log[4096:].decode()
    assert last.startswith("\n[tpu-portal] The log was cut here, after 4096 bytes")
    assert last.endswith("its further output was discarded.\n") and last.count("\n") == 2
    assert state.log_size == len(log)


def test_a_job_printing_a_line_at_a_time_keeps_every_line_up_to_the_cap(host):
    # Each line is a read of its own for the log's writer: the cap counts bytes, not
    # reads (with a 4 KiB cap, the first read used to end the log).
    job_id = new_job_id()
    lines = "".join(f"line {n}\n" for n in range(20))
    host.start(
        job_id,
        "n=0; while [ $n -lt 20 ]; do echo line $n; n=$((n + 1)); sleep 0.02; done;"
        " head -c 5000 /dev/zero | tr '\\0' b",
        log_max_bytes=4096,
    )
    state = host.wait_for(job_id, lambda j: j.state == "ended").jobs[job_id]
    assert state.exit_status == 0
    log = state.log.decode()
    assert log[:4096] == lines + "b" * (4096 - len(lines))
    assert log[4096:].startswith("\n[tpu-portal] The log was cut here, after 4096 bytes")


# --- folders -----------------------------------------------------------------------------


def test_old_folders_of_ended_jobs_expire_and_a_running_jobs_never_does(host):
    ended, running, lost = new_job_id(), new_job_id(), new_job_id()
    host.start(lost, "sleep 300")
    host.fleet.reboot(host.host.name)  # its folder is of an earlier boot now
    host.start(ended, "true")
    host.wait_for(ended, lambda j: j.state == "ended")
    host.start(running, "sleep 300")
    for job_id in (ended, running, lost):
        host.sh(f"touch -d '40 days ago' {JOBS}/{job_id}/* {JOBS}/{job_id}")
    host.start(new_job_id(), "true")  # keeps folders forever: removes nothing
    assert all(host.exists(f"{JOBS}/{j}") for j in (ended, running, lost))

    refused = host.start(new_job_id(), "true", keep_days=30)
    assert refused.outcome == "refused"  # the running job holds the TPU; expiry still runs
    deadline = time.monotonic() + 10
    while (host.exists(f"{JOBS}/{ended}") or host.exists(f"{JOBS}/{lost}")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not host.exists(f"{JOBS}/{ended}") and not host.exists(f"{JOBS}/{lost}")
    assert host.exists(f"{JOBS}/{running}")
    assert host.status(running).jobs[running].state == "running"


def test_a_cancel_of_a_folder_from_an_earlier_boot_kills_nothing_of_anyone_else(host):
    job_id = new_job_id()
    host.start(job_id, "exec sleep 300")
    host.fleet.reboot(host.host.name)
    other = f"{host.user}o"
    host.sh(f"useradd -m -u {next(_uids)} {other}")
    host.sh(f"setpriv --reuid={other} --regid={other} --init-groups -- setsid sleep 301 "
            "</dev/null >/dev/null 2>&1 &")  # fmt: skip
    pid = host.sh("pgrep -f 'sleep 301'").split()[0]
    start = host.sh(f"cut -d' ' -f22 /proc/{pid}/stat").strip()
    # As if the old job's supervisor and command had the pids the other person's
    # process has now (pids start over at each boot): even with the same start time.
    host.sh(f"echo '{pid} {start}' > {JOBS}/{job_id}/pid; cp {JOBS}/{job_id}/pid "
            f"{JOBS}/{job_id}/supervisor; rm -f {JOBS}/{job_id}/cgroup")  # fmt: skip
    try:
        (how, lock_free), empty = host.cancel(job_id, grace=0)
        assert (how, lock_free, empty) == ("lost", True, True)
        assert host.sh(f"ps -o args= -p {pid}").strip() == "sleep 301"
        # Of this boot, but the recorded start time is not the process's: nothing either.
        boot = host.sh("cat /proc/sys/kernel/random/boot_id").strip()
        host.sh(f"echo {boot} > {JOBS}/{job_id}/boot_id; echo '{pid} {int(start) + 1}' | "
                f"tee {JOBS}/{job_id}/pid > {JOBS}/{job_id}/supervisor")  # fmt: skip
        (how, _), _ = host.cancel(job_id, grace=0)
        assert host.sh(f"ps -o args= -p {pid}").strip() == "sleep 301"
    finally:
        host.sh(f"pkill -KILL -u {other} || true")


# --- through the portal: the job pass on a 4-worker pod -------------------------------


def _left(vm) -> list[str]:
    """What runs as the pod's person on any of its workers (zombies do not count)."""
    found = []
    for h in vm.hosts:
        out = vm.fleet.exec(h.name, ["sh", "-c", f"ps -u {vm.user} -o stat=,args= || true"])
        found += [f"{h.name}: {ln}" for ln in out.stdout.decode().splitlines() if ln[:1] != "Z"]
    return found


@pytest.mark.slow
def test_through_the_portal_nothing_of_a_job_outlives_its_end_or_its_time_limit(
    jobs_pod,  # noqa: F811
    django_capture_on_commit_callbacks,
):
    escape = f"{ESCAPE}; sleep 0.5"
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sh", "-c", escape])
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended)
    assert job.state == JobState.SUCCEEDED, job.reason
    assert _left(jobs_pod) == []

    stay = f"{ESCAPE}; exec sleep 300"
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="", args=["sh", "-c", stay],
                 time_limit_minutes=1)  # fmt: skip
    job = drive(jobs_pod.vm, job, lambda j: all("escaped" in p.log_tail for p in j.parts.all()))
    assert len(_left(jobs_pod)) == 8  # the command and what left its group, on 4 workers
    Job.objects.filter(pk=job.pk).update(started_at=job.started_at - dt.timedelta(minutes=2))
    job = drive(jobs_pod.vm, job, lambda j: j.has_ended, timeout=30)
    assert job.state == JobState.FAILED and "time limit" in job.reason
    assert _left(jobs_pod) == []


@pytest.mark.slow
def test_through_the_portal_a_cancel_of_a_job_that_ignores_term_is_done_at_the_grace(
    jobs_pod,  # noqa: F811
    django_capture_on_commit_callbacks,
    settings,
):
    settings.PORTAL_JOB_CANCEL_GRACE_SECONDS = 2
    stubborn = f"trap '' TERM; {ESCAPE}; while :; do sleep 1; done"
    job = submit(jobs_pod, django_capture_on_commit_callbacks, script="",
                 args=["sh", "-c", stubborn])  # fmt: skip
    job = drive(jobs_pod.vm, job, lambda j: all("escaped" in p.log_tail for p in j.parts.all()))
    with django_capture_on_commit_callbacks(execute=False):
        jobs.cancel_job(job, jobs_pod.milo)
    job_engine.advance(jobs_pod.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert _left(jobs_pod) == []
    # Each worker writes the end once the job's cgroup there is empty.
    gone = max(p.ended_at for p in job.parts.all()) - job.cancel_requested_at
    print(f"\ncancel -> nothing left on 4 workers, grace 2 s: {gone.total_seconds():.2f} s")
    assert 2.0 <= gone.total_seconds() < 3.5  # one status round, the grace, the KILL

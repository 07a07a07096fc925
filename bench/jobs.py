"""Jobs on a pod: submit → running on every worker, beside a serial ssh loop; the end
of a job and a failed worker as the periodic poll sees them; what a poll costs in SSH
sessions; the query counts of the job pages with 50,000 jobs.

    sudo-capable root shell, from the repository root:
    .venv/bin/python -m bench.jobs [--sizes 4,32] [--reps 5] [--poll 5]

What runs: a fleet of real sshd hosts (testfleet), one set per VM; the Cloud TPU
emulator with one node per size whose workers are those hosts; PostgreSQL and Redis (a
database of this run's own); JAX's CPU build linked into the collaborator's home as
his Python environment (the pre-flight reads its versions). The job itself is
``sleep``, so a Python start of the job's own is never part of a figure.

1. submit → running (in this process): ``submit_job`` then one ``advance`` pass (the
   pre-flight and the start fanned out over every worker) until it returns with the
   job RUNNING and a pid on every worker. Beside it, plain OpenSSH with the lab's own
   key and the pinned known_hosts runs the same two shipped scripts with the same
   command line and the same bytes on stdin, one worker after the other.
2. end of a job → state (a real ``celery worker`` and ``celery beat`` polling every
   ``PORTAL_JOB_POLL_SECONDS``): from the job's end on the workers (the last worker's
   ``ended_at``) to SUCCEEDED in the database, and to the job queued behind it
   RUNNING. A trigger in the run's own database sends a NOTIFY at each commit that
   changes a job's state, with PostgreSQL's clock at that commit.
3. one worker's process killed → the job FAILED and every worker's part stopped.
4. SSH sessions per worker per poll round with one running job and many ended ones,
   from the hosts' sshd logs (``Accepted publickey``) over N rounds of the real beat.
5. queries of the VM page, the VM's jobs page and the lab's usage page with 100 and
   with 50,000 jobs (``bench/jobpages.py``: a lab of rows only, nothing on hosts);
   pages whose URL name does not resolve are skipped and named.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from bench import jobpages
from bench.common import Stack, machine, median, run_on_fleet, table
from bench.provision import SSH_OPTIONS, new_keypair

PROJECT, ZONE = "bench-jobs", "us-central2-b"
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
JOB_CHANNEL = "bench_job_state"
ENDED = {"succeeded", "failed", "cancelled", "lost", "rejected"}
_ANSWER = re.compile(r"^([a-z][a-z0-9_.-]*)=(.*)$")
HEADERS = {
    "1": ["workers", "portal", "portal min", "portal max", "serial ssh", "serial min",
          "portal/serial", "target", "median ≤ target"],
    "1 phases": ["workers", "submit_job", "pre-flight fan-out", "start fan-out",
                 "rest of the pass", "serial pre-flight", "serial start"],
    "1 cpu": ["workers", "pass", "CPU-s: this process", "PostgreSQL", "the rest (hosts)",
              "CPU-s per worker (hosts)", "processes per worker"],
    "2": ["workers", "job length", "end → SUCCEEDED", "end → next RUNNING",
          "SUCCEEDED → next RUNNING"],
    "3": ["workers", "killed worker", "→ FAILED", "→ last worker stopped",
          "kill command → FAILED", "processes left"],
    "2-3 summary": ["workers", "SUCCEEDED med", "max", "≤ poll + 1", "next med", "max", "≤ 2 s",
                    "FAILED med", "max", "≤ poll + grace"],
    "4": ["workers", "jobs (running + ended)", "poll rounds", "passes", "sessions/worker",
          "sessions/worker/round", "commands/worker/round"],
}  # fmt: skip


class JobStates:
    """When a job's state changes, as committed. A constraint trigger deferred to the
    commit sends a NOTIFY with the job, its new state and PostgreSQL's clock at that
    moment (the clock every part of this run shares), so a notification read a little
    later still carries the time the state became visible."""

    def __init__(self) -> None:
        import psycopg
        from django.db import connection

        from tpus.models import Job

        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION bench_job_state() RETURNS trigger AS $$ BEGIN "
                "IF NEW.state IS DISTINCT FROM OLD.state THEN "
                f"PERFORM pg_notify('{JOB_CHANNEL}', NEW.id || ' ' || NEW.state || ' ' "
                "|| extract(epoch FROM clock_timestamp())); "
                "END IF; RETURN NULL; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE CONSTRAINT TRIGGER bench_job_state AFTER UPDATE ON {Job._meta.db_table} "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION bench_job_state()"
            )
        db = connection.settings_dict
        self.conn = psycopg.connect(
            dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"] or None,
            host=db["HOST"] or None, port=db["PORT"] or None, autocommit=True,
        )  # fmt: skip
        self.conn.execute(f"LISTEN {JOB_CHANNEL}")
        self.seen: dict[int, list[tuple[str, float]]] = defaultdict(list)

    def wait(self, job_id: int, states: set[str], deadline: float) -> tuple[str | None, float]:
        """(state, commit time) of the first change of job ``job_id`` into one of
        ``states``; (None, now) at the deadline."""
        while True:
            for state, at in self.seen.get(job_id, []):
                if state in states:
                    return state, at
            remaining = deadline - time.time()
            if remaining <= 0:
                return None, time.time()
            for note in self.conn.notifies(timeout=remaining, stop_after=1):
                pk, state, at = note.payload.split()
                self.seen[int(pk)].append((state, float(at)))


class CpuMeter:
    """CPU seconds spent over a stretch of time on the whole machine, split into this
    process (the portal's pass: Django, paramiko, every thread), the PostgreSQL backend
    of its connection, and the rest: sshd, sudo and the scripts on the fleet's hosts
    (plus whatever else runs on the machine, so figures are upper bounds), and the
    processes started meanwhile (from /proc/stat's fork counter)."""

    def __init__(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            self.backend = cursor.fetchone()[0]
        self.tick = os.sysconf("SC_CLK_TCK")

    def _backend(self) -> float:
        # The backend runs on this machine (the benchmark's PostgreSQL is local).
        try:
            fields = Path(f"/proc/{self.backend}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick

    def _machine(self) -> tuple[float, int]:
        busy, forks = 0.0, 0
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("cpu "):
                v = [int(x) for x in line.split()[1:]]
                busy = (sum(v[:8]) - v[3] - v[4]) / self.tick  # without idle and iowait
            elif line.startswith("processes "):
                forks = int(line.split()[1])
        return busy, forks

    def snapshot(self) -> tuple[float, float, float, int]:
        me = os.times()
        busy, forks = self._machine()
        return me.user + me.system, self._backend(), busy, forks

    @staticmethod
    def spent(before, after) -> dict:
        mine, backend = after[0] - before[0], after[1] - before[1]
        return {
            "cpu_self": mine,
            "cpu_db": backend,
            "cpu_rest": max(0.0, (after[2] - before[2]) - mine - backend),
            "forks": after[3] - before[3],
        }


class Bench:
    def __init__(self, args):
        self.args = args
        self.tag = secrets.token_hex(2)
        self.rng = random.Random(int(self.tag, 16))
        self.stack = Stack("jobs")
        self.dir = self.stack.dir
        self.fleet = None
        self.emulator = None
        self.fanouts: dict[str, float] = {}
        self.counter = 0
        self.cpu: CpuMeter | None = None

    # --- scene --------------------------------------------------------------------------

    def start(self) -> None:
        from testfleet.fleet import Fleet

        if not Path(JAX_ENV, "bin", "python").exists():
            raise SystemExit(f"JAX's CPU build is not in {JAX_ENV} (bin/setup test)")
        hosts_needed = sum(self.args.sizes)
        print(f"starting a fleet of {hosts_needed} sshd hosts …", flush=True)
        self.fleet = Fleet.open_free()
        self.fleet.teardown()  # leftovers of a crashed run in this slot
        self.fleet.up(hosts_needed)
        self.hosts = [self.fleet.host(f"h{i}") for i in range(1, hosts_needed + 1)]
        self.known_hosts = self.dir / "known_hosts"
        self.known_hosts.write_text(
            "".join(f"{h.ip} {key}\n" for h in self.hosts for key in self.fleet.host_keys(h.name))
        )
        from tpus.emulator.testing import start_emulator

        self.emulator = start_emulator(self.dir / "tpu-emulator.json")
        self.stack.setup_django(
            BENCH_TPU_API_ENDPOINT=self.emulator.endpoint,
            BENCH_REMOTE_ALLOWED_NETWORKS=f"127.0.0.0/8,{self.fleet.network}",
            PORTAL_ADMIN_SSH_KEY_FILE=self.fleet.admin_key_path,
            PORTAL_ADMIN_SSH_USER=self.fleet.admin_user,
            PORTAL_UID_MIN=70_000,
            PORTAL_UID_MAX=79_999,
            PORTAL_REMOTE_CONNECT_TIMEOUT=5,
            PORTAL_REMOTE_AUTH_TIMEOUT=10,
            PORTAL_REMOTE_SCRIPT_TIMEOUT=60,
            PORTAL_JOB_POLL_SECONDS=self.args.poll,
            PORTAL_JOB_CANCEL_GRACE_SECONDS=self.args.grace,
            # Beat's other rounds once an hour: no inventory sync or reconcile sweep
            # opens an SSH session while the poll's sessions are counted.
            PORTAL_SYNC_SECONDS=3600,
            PORTAL_RECONCILE_SWEEP_SECONDS=3600,
            PORTAL_EXPIRY_CHECK_SECONDS=3600,
        )
        import logging

        logging.getLogger("tpus").setLevel(logging.WARNING)
        self.states = JobStates()
        self._scene()
        self._time_fanouts()

    def _scene(self) -> None:
        from django.conf import settings
        from django.utils import timezone

        from accounts.keys import add_key
        from accounts.models import User
        from accounts.unix import choose_username
        from portal import secrets as portal_secrets
        from tpus.models import Lab, Membership
        from tpus.services import inventory
        from tpus.services.grants import grant_access
        from tpus.services.labkeys import lab_key
        from tpus.services.reconcile import reconcile_vm

        self.lab = Lab.objects.create(
            name="Bench Jobs", slug="bench-jobs", gcp_project_id=PROJECT, zones=[ZONE]
        )
        key = lab_key(self.lab)
        for host in self.hosts:
            self.fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [key.public_line]})
        # The same private key for the plain ssh loop (a file only this run reads).
        self.lab_key_file = self.dir / "lab_key"
        self.lab_key_file.write_bytes(portal_secrets.decrypt(key.private_key_encrypted))
        self.lab_key_file.chmod(0o600)

        approved = {"state": "approved", "policy_version_accepted": self.lab.policy_version,
                    "policy_accepted_at": timezone.now()}  # fmt: skip
        self.admin = User.objects.create_user(email="boss@jobs.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=self.admin, role="admin", **approved)
        self.vms, self.vm_hosts = {}, {}
        offset = 0
        for size in self.args.sizes:
            hosts = self.vm_hosts[size] = self.hosts[offset : offset + size]
            offset += size
            self.emulator.controls.add_node(
                PROJECT, ZONE, f"jobs{size}", accelerator_type=f"v4-{8 * size}", workers=size,
                internal_ips=[h.ip for h in hosts], external_ips=[h.ip for h in hosts],
                host_keys={
                    i: {k.split()[0]: k for k in self.fleet.host_keys(h.name)}
                    for i, h in enumerate(hosts)
                },
            )  # fmt: skip
        names = [f"{ZONE}/jobs{size}" for size in self.args.sizes]
        for vm in inventory.import_vms(self.admin, self.lab, names):
            workers = list(vm.workers.all())
            if any(not w.is_pinned for w in workers):
                raise RuntimeError(f"{vm.name}: unpinned workers")
            self.vms[len(workers)] = vm

        name = f"bj{self.tag}"
        user = User.objects.create_user(email=f"{name}@jobs.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=user, role="member", **approved)
        choose_username(user, name)
        add_key(user, new_keypair(self.dir / f"id_{name}", f"{name}@laptop"))
        grants = grant_access(self.admin, self.lab, user, list(self.vms.values()), sudo=False)
        print("giving the collaborator access (one reconcile per VM, in this process) …")
        for vm in self.vms.values():
            reconcile_vm(vm.pk)
        for grant in grants:
            grant.refresh_from_db()
            if grant.state != "active":
                raise RuntimeError(f"the grant on {grant.vm.name} is {grant.state}: {grant.error}")
        self.user = User.objects.select_related("unix_account").get(pk=user.pk)
        self.username = self.user.unix_account.username
        home = f"/home/{self.username}"
        for host in self.hosts:
            self.fleet.exec(host.name, ["sh", "-c", f"ln -sfn {JAX_ENV} {home}/jax && "
                                        f"chown -h {self.username}: {home}/jax"])  # fmt: skip

    def _time_fanouts(self) -> None:
        """Time each fan-out of this process's passes by script (wraps the names the
        jobs service calls; changes no behaviour). A pre-flight and start in one exec
        count as the pre-flight until every worker answered it, then as the start."""
        from tpus.remote import Held
        from tpus.services import job_engine as service

        fanouts = self.fanouts

        def timed(original, name_of):
            def wrapper(this, *args, **kwargs):
                began = time.perf_counter()
                try:
                    return original(this, *args, **kwargs)
                finally:
                    name = name_of(this, *args)
                    fanouts[name] = fanouts.get(name, 0.0) + time.perf_counter() - began

            return wrapper

        def named(_, script, *rest):
            return str(getattr(script, "name", script))

        service._Hosts.run = timed(service._Hosts.run, named)
        service._Hosts.begin = timed(service._Hosts.begin, named)
        Held.go = timed(Held.go, lambda held, *_: held.then.name)

    def spec(self, *args: str):
        from tpus.services.jobs import JobSpec

        return JobSpec(args=list(args or ("sleep", "600")), python="~/jax")

    def submit(self, size: int, *args: str):
        from tpus.services.jobs import submit_job

        return submit_job(self.user, self.vms[size], self.spec(*args))

    # --- 1. submit → running, beside a serial ssh loop ------------------------------------

    def portal_start(self, size: int) -> tuple[float, dict]:
        from tpus.services import job_engine, jobs

        vm = self.vms[size]
        self.fanouts.clear()
        if self.cpu is None:
            self.cpu = CpuMeter()
        t0 = time.perf_counter()
        job = self.submit(size)
        t1 = time.perf_counter()
        before = self.cpu.snapshot()
        report = job_engine.advance(vm.pk)
        after = self.cpu.snapshot()
        t2 = time.perf_counter()
        job.refresh_from_db()
        parts = list(job.parts.order_by("index"))
        if job.state != "running" or report.started != [job.pk]:
            raise RuntimeError(f"the job on {size} workers is {job.state}: {job.reason}")
        if [p.state for p in parts] != ["running"] * size or not all(p.pid for p in parts):
            raise RuntimeError(f"not every worker runs the job: {[p.state for p in parts]}")
        # Not timed: the last worker really runs the command, then the job is stopped.
        self._check_alive(self.vm_hosts[size][-1], parts[-1].pid)
        jobs.cancel_job(job, self.user)
        job_engine.advance(vm.pk)
        job.refresh_from_db()
        if job.state != "cancelled":
            raise RuntimeError(f"the job did not stop: {job.state} {job.reason}")
        preflight = self.fanouts.get("job-preflight.sh", 0.0)
        start = self.fanouts.get("job-start.sh", 0.0)
        return t2 - t0, {
            "submit": t1 - t0,
            "preflight": preflight,
            "start": start,
            "rest": (t2 - t1) - preflight - start,
            "pass": t2 - t1,
            **CpuMeter.spent(before, after),
        }

    def _check_alive(self, host, pid: int) -> None:
        done = self.fleet.exec(host.name, ["cat", f"/proc/{pid}/cmdline"], check=False)
        if done.returncode != 0 or not done.stdout.startswith(b"sleep"):
            raise RuntimeError(f"{host.name}: no job process {pid}")

    def serial_start(self, size: int) -> tuple[float, dict]:
        """The same pre-flight then start with plain ``ssh``, one worker after another:
        the door's own command line, the lab's key, the pinned known_hosts, the same
        bytes on stdin (the script, then the data encoded as the portal encodes it)."""
        from django.conf import settings

        from tpus.remote import jobs as wire
        from tpus.remote import run_on_workers
        from tpus.remote.scripts import load
        from tpus.services.hosts import remote_worker
        from tpus.services.job_engine import chip_layout
        from tpus.services.jobs import clean_spec
        from tpus.services.labkeys import login_for

        vm = self.vms[size]
        workers = list(vm.workers.order_by("index"))
        hosts = self.vm_hosts[size]
        spec = clean_spec(self.spec(), self.username)
        chips, glob = chip_layout(vm, size)
        port = settings.PORTAL_JOB_COORDINATOR_PORT
        self.counter += 1
        job_id = f"serial-{size}-{self.counter}-{self.tag}"
        preflights = [
            wire.encode_preflight(
                wire.Preflight(
                    user=self.username, chips=chips, device_glob=glob,
                    min_disk_mb=settings.PORTAL_JOB_MIN_DISK_MB,
                    min_mem_mb=settings.PORTAL_JOB_MIN_MEM_MB,
                    coordinator_port=port if size > 1 and w.index == 0 else None,
                    python=spec.python, script=spec.script,
                    env_names=tuple(n for n, _ in spec.env),
                )
            )
            for w in workers
        ]  # fmt: skip
        coordinator = f"{workers[0].internal_ip or workers[0].external_ip}:{port}"
        t0 = time.perf_counter()
        reports = []
        for host, data in zip(hosts, preflights, strict=True):
            pairs = self._ssh(host, load("job-preflight.sh"), data)
            reports.append(wire.parse_preflight(v for k, v in pairs if k == "check"))
        if not all(r.ok for r in reports):
            raise RuntimeError(f"serial pre-flight failed: {[r.failures for r in reports]}")
        t1 = time.perf_counter()
        env = list(spec.env)
        found = reports[0].detail("tcmalloc")
        if spec.use_tcmalloc and found.startswith("/"):
            env.append(("LD_PRELOAD", found.split()[0]))
        for index, host in enumerate(hosts):
            data = wire.encode_start(
                wire.StartJob(
                    job_id=job_id, user=self.username, argv=tuple(spec.args), env=tuple(env),
                    python=spec.python, cwd=spec.cwd,
                    pod=wire.Pod(coordinator, size, index) if size > 1 else None,
                )
            )  # fmt: skip
            answer = wire.parse_start(dict(self._ssh(host, load("job-start.sh"), data)))
            if answer.outcome != "started":
                raise RuntimeError(f"serial start on {host.name}: {answer}")
        t2 = time.perf_counter()
        self._check_alive(hosts[-1], answer.pid)
        # Not timed: stop it on every worker through the door.
        login = login_for(vm.lab)
        remote = [remote_worker(w, login) for w in workers]
        outcomes = run_on_workers(remote, "job-cancel.sh", wire.encode_cancel(job_id, 0))
        if not all(o.ok for o in outcomes):
            raise RuntimeError(f"cannot stop the serial job: {[str(o.error) for o in outcomes]}")
        return t2 - t0, {"preflight": t1 - t0, "start": t2 - t1}

    def _ssh(self, host, script, data: bytes) -> list[tuple[str, str]]:
        from django.conf import settings

        from tpus.remote.ssh import command_for, framed

        payload = framed(script.body) + data
        done = subprocess.run(
            ["ssh", *SSH_OPTIONS, "-i", str(self.lab_key_file),
             "-o", f"UserKnownHostsFile={self.known_hosts}",
             f"{settings.PORTAL_LAB_SSH_USER}@{host.ip}", command_for(script)],
            input=payload, capture_output=True, timeout=60,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{script.name} on {host.name}: {done.stderr.decode()[-500:]}")
        lines = done.stdout.decode(errors="replace").splitlines()
        return [(m[1], m[2]) for line in lines if (m := _ANSWER.match(line))]

    def part1(self) -> None:
        rows, phases, cpu = [], [], []
        for size in self.args.sizes:
            self.portal_start(size)  # untimed warm-up of each way
            self.serial_start(size)
            portal, serial, p_phases, s_phases = [], [], [], []
            for rep in range(1, self.args.reps + 1):
                elapsed, parts = self.portal_start(size)
                portal.append(elapsed)
                p_phases.append(parts)
                elapsed, parts = self.serial_start(size)
                serial.append(elapsed)
                s_phases.append(parts)
                print(f"  {size:>2} workers, rep {rep}: portal {portal[-1]:.3f} s, "
                      f"serial ssh {serial[-1]:.3f} s", flush=True)  # fmt: skip
            target = 1.0 if size <= 4 else 2.5
            rows.append([
                size, median(portal), min(portal), max(portal), median(serial), min(serial),
                median(portal) / median(serial), target,
                "met" if median(portal) <= target else "MISSED",
            ])  # fmt: skip
            phases.append([
                size, *(median(p[k] for p in p_phases) for k in ("submit", "preflight", "start",
                                                                   "rest")),
                median(p["preflight"] for p in s_phases), median(p["start"] for p in s_phases),
            ])  # fmt: skip
            rest = median(p["cpu_rest"] for p in p_phases)
            cpu.append([
                size, median(p["pass"] for p in p_phases), median(p["cpu_self"] for p in p_phases),
                median(p["cpu_db"] for p in p_phases), rest, rest / size,
                median(p["forks"] for p in p_phases) / size,
            ])  # fmt: skip
        self.results["1"] = [
            "1. submit → running on every worker (seconds; job = `sleep`, no Python start "
            f"of its own; {self.args.reps} repetition(s) after one untimed warm-up)",
            table(HEADERS["1"], rows),
            "",
            "where the time went (medians, seconds): the portal's pass in this process, "
            "the serial loop's two halves",
            table(HEADERS["1 phases"], phases),
            "",
            "the pass's CPU (medians; the machine's counters, so the rest includes anything "
            "else running on it; the processes are those started on the whole machine)",
            table(HEADERS["1 cpu"], cpu),
        ]

    # --- 2, 3, 4: the real poll ---------------------------------------------------------

    def start_celery(self) -> None:
        import redis

        from bench.common import REDIS_URL

        # Part 1 queued passes no worker took (its passes ran in this process).
        redis.Redis.from_url(REDIS_URL).delete(self.stack.env["BENCH_QUEUE"])
        print(f"starting celery worker and beat (job poll every {self.args.poll} s) …")
        self.stack.start_worker()
        self.stack.start_beat()

    def _wait_state(self, job, states: set[str], timeout: float) -> float:
        state, at = self.states.wait(job.pk, states, time.time() + timeout)
        if state is None:
            job.refresh_from_db()
            raise RuntimeError(f"job {job.pk} stayed {job.state} ({job.reason}); wanted {states}")
        return at

    def _stop(self, job) -> None:
        """Cancel a job (untimed) and wait until it has ended."""
        from tpus.services.jobs import cancel_job

        cancel_job(job, self.user)
        self._wait_state(job, ENDED, 60)

    def end_to_state(self, size: int) -> list:
        from tpus.models import JobWorker

        length = 2.0 + self.rng.uniform(0, self.args.poll)
        first = self.submit(size, "sleep", f"{length:.2f}")
        second = self.submit(size)
        self._wait_state(first, {"running"}, 60)
        shown = self._wait_state(first, ENDED, length + 3 * self.args.poll + 60)
        first.refresh_from_db()
        if first.state != "succeeded":
            raise RuntimeError(f"the first job {first.state}: {first.reason}")
        running = self._wait_state(second, {"running"} | ENDED, 60)
        second.refresh_from_db()
        if second.state != "running":
            raise RuntimeError(f"the next job {second.state}: {second.reason}")
        ends = JobWorker.objects.filter(job=first).values_list("ended_at", flat=True)
        end = max(ends).timestamp()
        self._stop(second)
        return [size, length, shown - end, running - end, running - shown]

    def failure(self, size: int) -> list:
        from tpus.models import JobWorker

        job = self.submit(size)
        self._wait_state(job, {"running"}, 60)
        time.sleep(self.rng.uniform(0.2, self.args.poll))  # any moment between two polls
        index = self.rng.randrange(size)
        victim = JobWorker.objects.get(job=job, index=index)
        host = self.vm_hosts[size][index]
        killed = time.time()
        self.fleet.exec(host.name, ["kill", "-KILL", str(victim.pid)])
        failed = self._wait_state(job, ENDED, 3 * self.args.poll + self.args.grace + 60)
        job.refresh_from_db()
        parts = list(job.parts.order_by("index"))
        if job.state != "failed" or not job.reason.startswith(f"Worker {index} "):
            raise RuntimeError(f"the job {job.state}: {job.reason}")
        if any(p.state != "ended" or p.ended_at is None for p in parts):
            raise RuntimeError(f"not every worker stopped: {[p.state for p in parts]}")
        died = parts[index].ended_at.timestamp()
        stopped = max(p.ended_at for p in parts).timestamp()
        left = 0
        for host_, part in zip(self.vm_hosts[size], parts, strict=True):
            out = self.fleet.exec(host_.name, ["ps", "-e", "-o", "pgid="]).stdout.decode()
            left += sum(1 for line in out.split() if line == str(part.pid))
        return [size, index, failed - died, stopped - died, failed - killed, left]

    def part2_3(self) -> None:
        poll, grace = self.args.poll, self.args.grace
        rows, fails = [], []
        for size in self.args.sizes:
            for rep in range(1, self.args.reps + 1):
                rows.append(self.end_to_state(size))
                print(f"  {size:>2} workers, end → state, rep {rep}: {rows[-1][2]:.2f} s, "
                      f"next running {rows[-1][3]:.2f} s", flush=True)  # fmt: skip
            for rep in range(1, self.args.reps + 1):
                fails.append(self.failure(size))
                print(f"  {size:>2} workers, a worker killed, rep {rep}: failed after "
                      f"{fails[-1][2]:.2f} s", flush=True)  # fmt: skip
        summary = []
        for size in self.args.sizes:
            mine = [r for r in rows if r[0] == size]
            worst_shown = max(r[2] for r in mine)
            worst_gap = max(r[4] for r in mine)
            killed = [r for r in fails if r[0] == size]
            worst_fail = max(r[2] for r in killed)
            summary.append([
                size, median(r[2] for r in mine), worst_shown,
                "met" if worst_shown <= poll + 1 else "MISSED",
                median(r[4] for r in mine), worst_gap, "met" if worst_gap <= 2 else "MISSED",
                median(r[2] for r in killed), worst_fail,
                "met" if worst_fail <= poll + grace else "MISSED",
            ])  # fmt: skip
        self.results["2"] = [
            f"2. end of a job → state shown (real celery beat every {poll} s and a worker; "
            "seconds from the last worker's end of the job)",
            table(HEADERS["2"], rows),
        ]
        self.results["3"] = [
            f"3. one worker's process killed → job FAILED, every worker stopped (grace {grace} s; "
            "seconds from that worker's end)",
            table(HEADERS["3"], fails),
        ]
        self.results["2-3 summary"] = [
            f"summary (targets: SUCCEEDED ≤ poll + 1 s = {poll + 1} s, next job ≤ 2 s after it, "
            f"FAILED ≤ poll + grace = {poll + grace} s; judged on the worst sample)",
            table(HEADERS["2-3 summary"], summary),
        ]

    def _sshd_counts(self, size: int) -> list[tuple[int, int]]:
        counts = []
        for host in self.vm_hosts[size]:
            log = self.fleet.log(host.name)
            counts.append((log.count("Accepted publickey"), log.count("Starting session: command")))
        return counts

    def _events(self, since: float, task: str, args=None) -> int:
        return sum(
            1
            for e in self.stack.events.all()
            if e["kind"] == "task_start" and e["task"] == task and e["t"] > since
            and (args is None or e["args"] == args)
        )  # fmt: skip

    def part4(self) -> None:
        ended = self._bulk_ended_jobs(self.args.ended_jobs)
        running = {size: self.submit(size) for size in self.args.sizes}
        for job in running.values():
            self._wait_state(job, {"running"}, 60)
        rounds = self.args.poll_rounds
        # Begin between two rounds: after a poll's passes have all ended.
        began = time.time()
        while self._events(began, "tpus.tasks.poll_jobs") < 1:
            time.sleep(0.1)
        self.stack.events.wait_idle(timeout=4 * self.args.poll, settle=0.5)
        time.sleep(0.3)  # sshd writes its last lines after the client has gone
        before = {size: self._sshd_counts(size) for size in self.args.sizes}
        t_a = time.time()
        while self._events(t_a, "tpus.tasks.poll_jobs") < rounds:
            time.sleep(0.2)
        self.stack.events.wait_idle(timeout=4 * self.args.poll, settle=0.5)
        time.sleep(0.3)
        after = {size: self._sshd_counts(size) for size in self.args.sizes}
        polls = self._events(t_a, "tpus.tasks.poll_jobs")
        rows = []
        for size in self.args.sizes:
            passes = self._events(t_a, "tpus.tasks.advance_jobs", [self.vms[size].pk])
            sessions = [a[0] - b[0] for a, b in zip(after[size], before[size], strict=True)]
            commands = [a[1] - b[1] for a, b in zip(after[size], before[size], strict=True)]
            rows.append([
                size, f"1 + {ended[size]}", polls, passes,
                f"{min(sessions)}..{max(sessions)}",
                f"{min(sessions) / polls:.2f}..{max(sessions) / polls:.2f}",
                f"{min(commands) / polls:.2f}..{max(commands) / polls:.2f}",
            ])  # fmt: skip
        for job in running.values():
            self._stop(job)
        self.results["4"] = [
            f"4. SSH per poll: {polls} rounds of the real beat, one job running and many "
            "ended per VM (sshd `Accepted publickey` and `Starting session: command` lines)",
            table(HEADERS["4"], rows),
        ]

    def _bulk_ended_jobs(self, count: int) -> dict[int, int]:
        """``count`` ended jobs with their parts on each fleet VM, as rows (their folders
        on the hosts are long gone, as for old jobs)."""
        from django.utils import timezone

        from tpus.models import Job, JobWorker

        now = timezone.now()
        made = {}
        for size, vm in self.vms.items():
            workers = list(vm.workers.order_by("index"))
            rows = []
            for i in range(count):
                began, ended = now - timedelta(hours=i + 1), now - timedelta(hours=i)
                rows.append(Job(
                    vm=vm, user=self.user, host_id=f"old-{size}-{i}-{self.tag}",
                    state="succeeded" if i % 5 else "failed", args=["sleep", "1"],
                    python=f"/home/{self.username}/jax", queued_at=began, begun_at=began,
                    started_at=began, ended_at=ended, changed_at=ended,
                    worker_count=len(workers),
                ))  # fmt: skip
            rows = Job.objects.bulk_create(rows, batch_size=2000)
            parts = [
                JobWorker(job=job, worker=w, index=w.index, state="ended", pid=1000 + w.index,
                          ended_at=job.ended_at, exit_status=int(job.state != "succeeded"))
                for job in rows
                for w in workers
            ]  # fmt: skip
            JobWorker.objects.bulk_create(parts, batch_size=5000)
            made[size] = Job.objects.filter(vm=vm, state__in=list(ENDED)).count()
        return made

    # --- the run ---------------------------------------------------------------------

    def run(self) -> None:
        self.results: dict[str, list[str]] = {}
        parts = self.args.parts
        if "1" in parts:
            print("1. submit → running …", flush=True)
            self.part1()
        if parts & {"2", "3", "4"}:
            self.start_celery()
            if parts & {"2", "3"}:
                print("2, 3. the end of a job and a failed worker, as the poll sees them …")
                self.part2_3()
            if "4" in parts:
                print(f"4. SSH sessions over {self.args.poll_rounds} poll rounds …", flush=True)
                self.part4()
            self.stack.stop_processes()
        if "5" in parts:
            print(f"5. query counts with {self.args.usage_jobs:,} jobs …", flush=True)
            self.results["5"] = jobpages.query_counts(
                self.args.usage_small, self.args.usage_jobs, self.tag
            )
        print()
        print(f"machine: {machine()}")
        print(f"sizes {self.args.sizes}, {self.args.reps} repetitions, "
              f"PORTAL_JOB_POLL_SECONDS={self.args.poll}, "
              f"PORTAL_JOB_CANCEL_GRACE_SECONDS={self.args.grace}")  # fmt: skip
        for key in ("1", "2", "3", "2-3 summary", "4", "5"):
            if key in self.results:
                print()
                print("\n".join(self.results[key]))

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            if self.emulator is not None:
                self.emulator.stop()
            if self.fleet is not None:
                self.fleet.destroy()
            shutil.rmtree(self.dir, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,32", help="workers per pod (default 4,32)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per size (1..20)")
    parser.add_argument("--poll", type=int, default=5, help="PORTAL_JOB_POLL_SECONDS (default 5)")
    parser.add_argument(
        "--grace",
        type=int,
        default=10,
        help="PORTAL_JOB_CANCEL_GRACE_SECONDS (default 10, as in production)",
    )
    parser.add_argument("--poll-rounds", type=int, default=5, help="poll rounds counted in part 4")
    parser.add_argument(
        "--ended-jobs",
        type=int,
        default=500,
        help="ended jobs per VM beside the running one in part 4",
    )
    parser.add_argument("--usage-jobs", type=int, default=50_000, help="jobs in part 5")
    parser.add_argument("--usage-small", type=int, default=100, help="the small count in part 5")
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run (default all)")
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.reps = max(1, min(args.reps, 20))
    args.parts = set(args.parts.split(","))
    return run_on_fleet(Bench(args))


if __name__ == "__main__":
    sys.exit(main())

"""Click → every worker verified, for 1, 8 and 32 workers, beside ansible-core and a
serial ssh loop on the same fleet hosts, in one run.

    sudo-capable root shell, from the repository root:
    /work/main/.venv/bin/python -m bench.provision [--sizes 1,8,32] [--reps 5]

What runs: a fleet of real sshd hosts (testfleet), the Cloud TPU emulator with one node
per size whose workers are fleet hosts (host keys from the fleet), PostgreSQL and Redis
(a database of this run's own), and a real ``celery worker`` subprocess. The "click" is
the service call a view makes, ``grant_access``, which enqueues ``reconcile_vm`` on
commit; "verified" is the Grant row reaching ``active`` (every worker applied it),
seen through a NOTIFY that PostgreSQL sends when that change commits. After the
timing, a real ``ssh`` login as the new user on the last worker checks the result.
Every repetition uses new user names.

Beside it, on the same hosts: ansible-playbook (``user`` + ``ansible.posix.authorized_key``,
become, forks = worker count, the fleet's admin key and pinned known_hosts) and a
serial loop of plain ``ssh`` commands (``sudo useradd … && install`` the key per host).
Then one no-op reconcile is counted in the hosts' sshd logs (sessions, commands).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.utils import timezone

from bench.common import Stack, machine, median, run_on_fleet, table

PROJECT, ZONE = "bench-lab", "us-central1-f"
ACCELERATORS = {1: "v4-8", 8: "v4-64", 32: "v4-256"}
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=5",
               "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR"]  # fmt: skip
GRANT_CHANNEL = "bench_grant_state"
VERIFY_TIMEOUT = 60.0


def new_keypair(path: Path, comment: str) -> str:
    """An ed25519 key pair at ``path`` (+ .pub); returns the public line."""
    key = ed25519.Ed25519PrivateKey.generate()
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    line = f"{public.decode()} {comment}"
    path.with_suffix(".pub").write_text(line + "\n")
    return line


@dataclass
class Sample:
    size: int
    portal: list[float] = field(default_factory=list)
    ansible: list[float] = field(default_factory=list)
    serial: list[float] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)


class GrantStates:
    """When a grant changes state, without polling. Polling the database every 5 ms
    cost about a third of a core (0.69 CPU-s in 2 s on this machine), which the fleet
    and the portal's worker share. Instead a trigger in the benchmark's own database
    sends a NOTIFY with each change of a grant's state; PostgreSQL delivers it when
    the change commits, to a connection that sleeps until then."""

    def __init__(self) -> None:
        import psycopg
        from django.db import connection

        from tpus.models import Grant

        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION bench_grant_state() RETURNS trigger AS $$ BEGIN "
                "IF NEW.state IS DISTINCT FROM OLD.state THEN "
                f"PERFORM pg_notify('{GRANT_CHANNEL}', NEW.id || ' ' || NEW.state); "
                "END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            cursor.execute(
                f"CREATE TRIGGER bench_grant_state AFTER UPDATE ON {Grant._meta.db_table} "
                "FOR EACH ROW EXECUTE FUNCTION bench_grant_state()"
            )
        db = connection.settings_dict
        self.conn = psycopg.connect(
            dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"] or None,
            host=db["HOST"] or None, port=db["PORT"] or None, autocommit=True,
        )  # fmt: skip
        self.conn.execute(f"LISTEN {GRANT_CHANNEL}")

    def wait(self, grant_id: int, states: tuple[str, ...], deadline: float):
        """(state, time.time() when it arrived) once grant ``grant_id`` reaches one of
        ``states``; (None, now) at the deadline."""
        while (remaining := deadline - time.time()) > 0:
            for note in self.conn.notifies(timeout=remaining):
                pk, state = note.payload.split()
                if int(pk) == grant_id and state in states:
                    return state, time.time()
        return None, time.time()


class Bench:
    def __init__(self, args):
        self.args = args
        self.tag = secrets.token_hex(2)
        self.stack = Stack("bench")
        self.fleet = None
        self.emulator = None
        self.dir = self.stack.dir
        # Fresh UID ranges per run, far above anything on the machine: portal, ansible, loop.
        # The portal's default range; the bench's fleet is its own, made for this run.
        self.uid_base = 70_000
        self.counter = 0

    # --- scene ------------------------------------------------------------------------

    def start(self) -> None:
        from testfleet.fleet import Fleet

        # Each VM gets hosts of its own, as in the cloud: VMs that shared a host would
        # undo each other's users there on every reconcile.
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
            PORTAL_UID_MIN=self.uid_base,
            PORTAL_UID_MAX=self.uid_base + 9_999,
            PORTAL_REMOTE_CONNECT_TIMEOUT=5,
            PORTAL_REMOTE_AUTH_TIMEOUT=10,
            PORTAL_REMOTE_SCRIPT_TIMEOUT=60,
        )
        # The worker logs every script run; here only the tables matter.
        logging.getLogger("tpus").setLevel(logging.WARNING)
        self.grant_states = GrantStates()
        self._scene()
        print("starting a celery worker …", flush=True)
        self.stack.start_worker()

    def _scene(self) -> None:
        from accounts.models import User
        from tpus.models import Lab, Membership
        from tpus.services import inventory

        self.lab = Lab.objects.create(
            name="Bench Lab", slug="bench", gcp_project_id=PROJECT, zones=[ZONE]
        )
        # The lab's own key on every host, as connecting the VMs does on Google's side.
        from django.conf import settings

        from tpus.services.labkeys import lab_key

        line = lab_key(self.lab).public_line
        for host in self.hosts:
            self.fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [line]})
        self.admin = User.objects.create_user(email="boss@bench.example", password="x" * 12)
        Membership.objects.create(
            lab=self.lab, user=self.admin, role="admin", state="approved",
            policy_version_accepted=self.lab.policy_version, policy_accepted_at=timezone.now(),
        )  # fmt: skip
        self.vms = {}
        self.vm_hosts = {}
        offset = 0
        for size in self.args.sizes:
            hosts = self.vm_hosts[size] = self.hosts[offset : offset + size]
            offset += size
            self.emulator.controls.add_node(
                PROJECT, ZONE, f"bench{size}", accelerator_type=ACCELERATORS.get(size, "v4-8"),
                workers=size, external_ips=[h.ip for h in hosts],
                host_keys={
                    i: {k.split()[0]: k for k in self.fleet.host_keys(h.name)}
                    for i, h in enumerate(hosts)
                },
            )  # fmt: skip
        names = [f"{ZONE}/bench{size}" for size in self.args.sizes]
        for vm in inventory.import_vms(self.admin, self.lab, names):
            self.vms[len(vm.workers.all())] = vm
            unpinned = [w.alias for w in vm.workers.all() if not w.is_pinned]
            if unpinned:
                raise RuntimeError(f"{vm.name}: unpinned workers {unpinned}")

    def _collaborator(self, size: int, rep: int):
        """A new approved member with a unix name and one key; returns (user, key path)."""
        from accounts.keys import add_key
        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Membership

        self.counter += 1
        name = f"bp{size}r{rep}x{self.tag}"
        user = User.objects.create_user(email=f"{name}@bench.example", password="x" * 12)
        Membership.objects.create(
            lab=self.lab, user=user, role="member", state="approved",
            policy_version_accepted=self.lab.policy_version, policy_accepted_at=timezone.now(),
        )  # fmt: skip
        choose_username(user, name)
        key = self.dir / f"id_{name}"
        add_key(user, new_keypair(key, f"{name}@laptop"))
        return User.objects.select_related("unix_account").get(pk=user.pk), key

    # --- the three ways -----------------------------------------------------------------

    def portal(self, size: int, rep: int) -> tuple[float, dict]:
        from tpus.models import Grant
        from tpus.services.grants import grant_access

        user, key = self._collaborator(size, rep)
        vm = self.vms[size]
        self.stack.events.wait_idle()
        t0 = time.time()
        [grant] = grant_access(self.admin, self.lab, user, [vm], sudo=False)
        t1 = time.time()
        state, t2 = self.grant_states.wait(grant.pk, ("active", "failed"), t0 + VERIFY_TIMEOUT)
        if state != "active":
            error = Grant.objects.get(pk=grant.pk).error
            raise RuntimeError(f"grant on {size} workers ended {state}: {error}")
        # Not timed: the collaborator really logs in on the last worker.
        last = self.vm_hosts[size][-1]
        self._check_login(last.ip, user.unix_account.username, key)
        self.stack.events.wait_idle()
        return t2 - t0, self._phases(t0, t1, t2, vm.pk)

    def _check_login(self, ip: str, username: str, key: Path) -> None:
        result = subprocess.run(
            ["ssh", *SSH_OPTIONS, "-i", str(key), "-o", f"UserKnownHostsFile={self.known_hosts}",
             f"{username}@{ip}", "id -un"],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if result.returncode != 0 or result.stdout.strip() != username:
            raise RuntimeError(f"{username} cannot log in to {ip}: {result.stderr.strip()}")

    def _phases(self, t0: float, t1: float, t2: float, vm_id: int) -> dict:
        """Where the click's time went, from the worker's probes."""
        events = self.stack.events.between(t0, t2)
        starts = [e for e in events if e["kind"] == "task_start"]
        start = next((e for e in starts if e["task"] == "tpus.tasks.reconcile_vm"), None)
        fanout = [e for e in events if e["kind"] == "fanout"]
        if start is None or not fanout:
            return {}
        first, last = fanout[0], fanout[-1]
        connects = [e["end"] - e["start"] for e in events if e["kind"] == "connect"]
        runs = [e["end"] - e["start"] for e in events if e["kind"] == "run"]
        settles = [e for e in events if e["kind"] == "settle"]
        settled = settles[-1]["end"] if settles else last["end"]
        return {
            "enqueue": t1 - t0,
            "pickup": start["t"] - t1,
            "prepare": first["start"] - start["t"],
            "connect_max": max(connects, default=0.0),
            "connect_med": median(connects),
            "script_max": max(runs, default=0.0),
            "fanout": sum(e["end"] - e["start"] for e in fanout),
            "record_settle": settled - last["end"],
            "seen": t2 - settled,
            "passes": len(fanout),
        }

    def ansible(self, size: int, rep: int) -> float:
        name = f"ba{size}r{rep}x{self.tag}"
        uid = self.uid_base + 10_000 + self.counter
        work = self.dir / f"ansible-{name}"
        work.mkdir()
        public = new_keypair(work / "id_user", f"{name}@laptop")
        hosts = self.vm_hosts[size]
        (work / "inventory.ini").write_text(
            "[fleet]\n"
            + "".join(f"{h.name} ansible_host={h.ip}\n" for h in hosts)
            + "\n[fleet:vars]\n"
            f"ansible_user={self.fleet.admin_user}\n"
            f"ansible_ssh_private_key_file={self.fleet.admin_key_path}\n"
            "ansible_python_interpreter=/usr/bin/python3\n"
        )
        (work / "ansible.cfg").write_text(
            "[defaults]\n"
            f"inventory = {work / 'inventory.ini'}\n"
            "host_key_checking = True\n"
            "gathering = explicit\n"
            "retry_files_enabled = False\n"
            f"local_tmp = {work / 'tmp'}\n"
            "[ssh_connection]\n"
            "ssh_args = -o ControlMaster=auto -o ControlPersist=60s -o IdentitiesOnly=yes "
            f"-o UserKnownHostsFile={self.known_hosts} -o StrictHostKeyChecking=yes\n"
            f"control_path_dir = {work / 'cp'}\n"
            f"pipelining = {'True' if self.args.ansible_pipelining else 'False'}\n"
        )
        (work / "playbook.yml").write_text(ANSIBLE_PLAYBOOK)
        env = {
            **os.environ,
            "ANSIBLE_CONFIG": str(work / "ansible.cfg"),
            "ANSIBLE_HOME": str(work / "home"),
            "ANSIBLE_NOCOLOR": "1",
        }
        command = [
            str(Path(sys.executable).with_name("ansible-playbook")), "-f", str(size),
            str(work / "playbook.yml"),
            "-e", json.dumps({"username": name, "uid": uid, "key": public}),
        ]  # fmt: skip
        t0 = time.time()
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        elapsed = time.time() - t0
        self._close_control_masters(work / "cp")
        if result.returncode != 0:
            raise RuntimeError(f"ansible failed on {size} hosts:\n{result.stdout[-3000:]}")
        self._check_login(hosts[-1].ip, name, work / "id_user")
        return elapsed

    @staticmethod
    def _close_control_masters(directory: Path) -> None:
        """Ansible leaves one ssh master per host for ControlPersist; stop them through
        their sockets so the next repetition starts cold, as a new run would."""
        if not directory.exists():
            return
        for socket in directory.iterdir():
            subprocess.run(
                ["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "fleet-host"],
                capture_output=True, timeout=10, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def serial(self, size: int, rep: int) -> float:
        name = f"bs{size}r{rep}x{self.tag}"
        uid = self.uid_base + 20_000 + self.counter
        key = self.dir / f"id_{name}"
        public = new_keypair(key, f"{name}@laptop")
        hosts = self.vm_hosts[size]
        command = (
            f"sudo -n sh -c 'useradd -m -U -u {uid} -s /bin/bash {name} && "
            f"install -d -m 700 -o {name} -g {name} /home/{name}/.ssh && "
            f"install -m 600 -o {name} -g {name} /dev/stdin /home/{name}/.ssh/authorized_keys'"
        )
        t0 = time.time()
        for host in hosts:
            subprocess.run(
                ["ssh", *SSH_OPTIONS, "-i", str(self.fleet.admin_key_path),
                 "-o", f"UserKnownHostsFile={self.known_hosts}",
                 f"{self.fleet.admin_user}@{host.ip}", command],
                input=public + "\n", capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
        elapsed = time.time() - t0
        self._check_login(hosts[-1].ip, name, key)
        return elapsed

    # --- the no-op reconcile ------------------------------------------------------------

    def noop(self) -> list[list]:
        """One reconcile with nothing to change, per VM: SSH sessions and commands each
        worker's sshd logged, and what the workers answered."""
        from tpus.services.reconcile import reconcile_vm

        rows = []
        for size in self.args.sizes:
            vm = self.vms[size]
            hosts = self.vm_hosts[size]
            before = {h.name: self._sshd_counts(h.name) for h in hosts}
            t0 = time.time()
            report = reconcile_vm(vm.pk)
            elapsed = time.time() - t0
            time.sleep(0.3)  # sshd writes its last lines after the client has gone
            after = {h.name: self._sshd_counts(h.name) for h in hosts}
            sessions = [after[n][0] - before[n][0] for n in before]
            commands = [after[n][1] - before[n][1] for n in before]
            noop = [
                (w.sync.last_report or {}).get("values", {}).get("noop")
                for w in vm.workers.select_related("sync")
            ]
            rows.append([
                size, elapsed, report.changed, f"{noop.count('1')}/{size}",
                f"{min(sessions)}..{max(sessions)}", f"{min(commands)}..{max(commands)}",
            ])  # fmt: skip
        return rows

    # --- where a worker's time goes ----------------------------------------------------

    def profile(self) -> list[list]:
        """The parts of one reconcile, each alone: SSH connect, the door with a trivial
        script, the reconcile script through the door and inside the host without SSH,
        then both fanned out over the largest VM. CPU columns: this process's own CPU
        (the paramiko client side) and the whole machine's busy CPU (/proc/stat), so
        that the fleet's sshds and scripts sharing the cores show."""
        from tpus.remote import config as remote_config
        from tpus.remote import run_on_workers, run_script, ssh
        from tpus.remote.desired import encode
        from tpus.remote.scripts import load
        from tpus.services.hosts import remote_worker
        from tpus.services.labkeys import login_for
        from tpus.services.reconcile import desired_state

        size = max(self.args.sizes)
        vm = self.vms[size]
        workers = list(vm.workers.order_by("index"))
        remote = [remote_worker(w, login_for(vm.lab)) for w in workers]
        data = encode(desired_state(vm))
        host = self.vm_hosts[size][0]
        script = load("reconcile.sh")

        def connect_only():
            ssh._connect(remote[0], remote_config.current()).close()

        def inside_host():
            self.fleet.exec(
                host.name, ["sh", "-c", script.body.decode(), "reconcile.sh"], input=data
            )

        steps = [
            ("paramiko connect + auth + close, 1 worker", connect_only),
            ("door: whoami.sh, 1 worker", lambda: run_script(remote[0], "whoami.sh")),
            ("door: reconcile.sh no-op, 1 worker", lambda: run_script(remote[0], script, data)),
            ("reconcile.sh no-op inside the host, no SSH (nsenter)", inside_host),
            (f"door: whoami.sh on {size} workers at once",
             lambda: run_on_workers(remote, "whoami.sh")),
            (f"door: reconcile.sh no-op on {size} workers at once",
             lambda: run_on_workers(remote, script, data)),
        ]  # fmt: skip
        rows = []
        for label, step in steps:
            walls, own, machine_busy = [], [], []
            for _ in range(5):
                busy0, cpu0, t0 = _machine_busy(), time.process_time(), time.perf_counter()
                step()
                wall = time.perf_counter() - t0
                walls.append(wall)
                own.append(time.process_time() - cpu0)
                machine_busy.append(_machine_busy() - busy0)
            rows.append([label, median(walls), median(own), median(machine_busy)])
        return rows

    def _sshd_counts(self, host: str) -> tuple[int, int]:
        """(connections, commands) the host's sshd has logged (LogLevel VERBOSE)."""
        log = self.fleet.log(host)
        connections = len(re.findall(r"^Connection from ", log, re.M))
        commands = len(re.findall(r"Starting session: command", log))
        return connections, commands

    # --- the run --------------------------------------------------------------------------

    def run(self) -> None:
        samples = {size: Sample(size) for size in self.args.sizes}
        for size in self.args.sizes:
            # One untimed round of each way first: imports, caches and first users.
            self.portal(size, 0)
            if not self.args.skip_ansible:
                self.ansible(size, 0)
            self.serial(size, 0)
            for rep in range(1, self.args.reps + 1):
                elapsed, phases = self.portal(size, rep)
                samples[size].portal.append(elapsed)
                samples[size].phases.append(phases)
                if not self.args.skip_ansible:
                    samples[size].ansible.append(self.ansible(size, rep))
                samples[size].serial.append(self.serial(size, rep))
                s = samples[size]
                line = f"  {size:>2} workers, rep {rep}: portal {elapsed:.3f} s"
                line += f", ansible {s.ansible[-1]:.3f} s" if s.ansible else ""
                print(f"{line}, serial ssh {s.serial[-1]:.3f} s", flush=True)
        self.report(samples)

    def report(self, samples: dict[int, Sample]) -> None:
        print()
        print(f"machine: {machine()}")
        print(f"repetitions: {self.args.reps} per size (after one untimed warm-up), medians")
        ansible_kind = "user + ansible.posix.authorized_key, become, forks = workers, gathering off"
        if self.args.ansible_pipelining:
            ansible_kind += ", pipelining on"
        print(f"ansible: {self.ansible_version()} ({ansible_kind})")
        print()
        rows = []
        for size, s in samples.items():
            portal, ansible, serial = median(s.portal), median(s.ansible), median(s.serial)
            rows.append([
                size, portal, min(s.portal), max(s.portal), ansible, serial,
                portal / ansible if s.ansible else float("nan"), portal / serial,
            ])  # fmt: skip
        print("click → every worker verified (seconds)")
        print(
            table(
                ["workers", "portal", "portal min", "portal max", "ansible", "serial ssh",
                 "portal/ansible", "portal/serial"],
                rows,
            )
        )  # fmt: skip
        print()
        print("portal: where the time went (medians, seconds; from the worker's probes)")
        keys = ["enqueue", "pickup", "prepare", "connect_med", "connect_max", "script_max",
                "fanout", "record_settle", "seen"]  # fmt: skip
        rows = []
        for size, s in samples.items():
            phases = [p for p in s.phases if p]
            rows.append([size, *[median(p[k] for p in phases) for k in keys]])
        print(table(["workers", *keys], rows))
        print()
        print("no-op reconcile (in-process service call, after the runs above)")
        print(
            table(
                ["workers", "seconds", "changed", "noop answers", "ssh sessions/worker",
                 "commands/worker"],
                self.noop(),
            )
        )  # fmt: skip
        if self.args.profile:
            print()
            print("one worker's reconcile, part by part (medians of 5; seconds)")
            print(
                table(
                    ["step", "wall", "portal process CPU", "machine CPU (all cores)"],
                    self.profile(),
                )
            )
        targets = samples.get(32)
        if targets and targets.ansible:
            portal, ratio = median(targets.portal), median(targets.portal) / median(targets.ansible)
            print()
            print(
                f"target, 32 workers ≤ 2 s: {'met' if portal <= 2 else 'MISSED'} ({portal:.2f} s); "
                f"≤ 0.2× ansible: {'met' if ratio <= 0.2 else 'MISSED'} ({ratio:.2f}×)"
            )

    @staticmethod
    def ansible_version() -> str:
        try:
            out = subprocess.run(
                [str(Path(sys.executable).with_name("ansible-playbook")), "--version"],
                capture_output=True, text=True, timeout=30,
            ).stdout  # fmt: skip
            return out.splitlines()[0].strip()
        except (OSError, IndexError):
            return "ansible-playbook (version unknown)"

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            if self.emulator is not None:
                self.emulator.stop()
            if self.fleet is not None:
                self.fleet.destroy()
            shutil.rmtree(self.dir, ignore_errors=True)


def _machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (all cores), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


ANSIBLE_PLAYBOOK = """\
- hosts: fleet
  gather_facts: false
  become: true
  tasks:
    - name: the collaborator's account
      ansible.builtin.user:
        name: "{{ username }}"
        uid: "{{ uid }}"
        shell: /bin/bash
        create_home: true
        password_lock: true
    - name: the collaborator's key
      ansible.posix.authorized_key:
        user: "{{ username }}"
        key: "{{ key }}"
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,32", help="worker counts (default 1,8,32)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per size (3..10)")
    parser.add_argument("--skip-ansible", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="also time a worker's reconcile part by part"
    )
    parser.add_argument(
        "--no-ansible-pipelining", dest="ansible_pipelining", action="store_false",
        help="run ansible with its default (pipelining off)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.reps = max(3, min(args.reps, 10))
    return run_on_fleet(Bench(args))


if __name__ == "__main__":
    sys.exit(main())

"""One lab's burst of Connects → another lab's IP-change email, not delayed.

    root shell, from the repository root:
    /work/main/.venv/bin/python -m bench.connects               # sync every 10 s, 3 rounds
    /work/main/.venv/bin/python -m bench.connects --sync 60 --reps 2

Lab A's admin presses Connect (``connect_vm``, what the view calls) on 5 TPU VMs whose
workers never accept the lab's key: real sshd hosts of the fleet where no guest agent
puts the key (as with OS Login on, or the agent stopped), so each Connect waits its
whole ``PORTAL_CONNECT_WAIT_SECONDS`` (180 s, the default) and then fails with the
reason. Right after the last Connect, lab B's worker changes its external address in
the Cloud TPU emulator, and the benchmark measures until lab B's collaborator's email
with the new address arrives at the SMTP sink. The same change without lab A's burst
is measured in the same run, round after round; between rounds lab A's VMs are
disconnected (which ends their checks).

A real ``celery worker`` (prefork, one process per core, as the README runs it) and
``celery beat`` (``PORTAL_SYNC_SECONDS`` = ``--sync``) as subprocesses, PostgreSQL and
Redis, the emulator on 127.0.0.1, SSH only to the fleet's own namespaces. The target
(DESIGN.md): email ≤ sync interval + 5 s, with or without the burst. The table also
shows how long the longest connection check task ran (the probes in
``bench.celeryapp``): no check waits for the workers inside a task.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import secrets
import shutil
import sys
import time

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from django.utils import timezone

from bench.common import Stack, machine, median, run_on_fleet, table
from bench.poll import Sink

ZONE = "us-central1-f"
PROJECT_A, PROJECT_B = "bench-lab-a", "bench-lab-b"
CHECK_TASK = "tpus.tasks.check_vm_connection"
SYNC_TASK = "tpus.tasks.sync_inventory"
VMS_A = 5


class ConnectsBench:
    def __init__(self, args):
        self.args = args
        self.stack = Stack("connects")
        self.fleet = None
        self.emulator = None
        self.sink = None

    # --- scene ------------------------------------------------------------------------

    def start(self) -> None:
        from testfleet.fleet import Fleet
        from tpus.emulator.testing import start_emulator

        print(f"starting a fleet of {VMS_A + 1} sshd hosts …", flush=True)
        self.fleet = Fleet.open_free()
        self.fleet.teardown()  # leftovers of a crashed run in this slot
        self.fleet.up(VMS_A + 1)
        self.hosts = [self.fleet.host(f"h{i}") for i in range(1, VMS_A + 1)]
        self.host_b = self.fleet.host(f"h{VMS_A + 1}")
        self.emulator = start_emulator(self.stack.dir / "tpu-emulator.json")
        self.sink = Sink()
        self.stack.setup_django(
            BENCH_TPU_API_ENDPOINT=self.emulator.endpoint,
            BENCH_REMOTE_ALLOWED_NETWORKS=f"127.0.0.0/8,{self.fleet.network}",
            PORTAL_ADMIN_SSH_KEY_FILE=self.fleet.admin_key_path,
            PORTAL_ADMIN_SSH_USER=self.fleet.admin_user,
            PORTAL_SYNC_SECONDS=self.args.sync,
            PORTAL_CONNECT_WAIT_SECONDS=self.args.connect_wait,
            PORTAL_TEST_EMAIL_URL=self.sink.url,
        )
        logging.getLogger("tpus").setLevel(logging.WARNING)
        logging.getLogger("mail.log").setLevel(logging.WARNING)
        self._scene()
        if self.args.hosts_down:
            # Dead VMs: connects to lab A's workers hang until the client's timeout.
            for host in self.hosts:
                self.fleet.down(host.name, hang=True)
        print(f"starting celery worker and beat (sync every {self.args.sync} s) …", flush=True)
        self.stack.start_worker()
        self.stack.start_beat()
        if self._sync_end_after(time.time() - 1, self.args.sync + 120) is None:
            raise RuntimeError("no sync ran:\n" + self.stack.log("beat")[-2000:])

    def _scene(self) -> None:
        from django.conf import settings
        from django.db.models import F

        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Grant, Lab, Membership, TpuVm
        from tpus.services import inventory
        from tpus.services.labkeys import lab_key

        controls = self.emulator.controls

        def lab(name: str, slug: str, project: str):
            made = Lab.objects.create(name=name, slug=slug, gcp_project_id=project, zones=[ZONE])
            admin = User.objects.create_user(email=f"boss@{slug}.example", password="x" * 12)
            Membership.objects.create(
                lab=made, user=admin, role="admin", state="approved",
                policy_version_accepted=made.policy_version, policy_accepted_at=timezone.now(),
            )  # fmt: skip
            return made, admin

        # Lab A: VMs on real hosts with pinned host keys, where the lab's key is never
        # put in place (no guest agent runs here).
        self.lab_a, self.admin_a = lab("Lab A", "lab-a", PROJECT_A)
        for i, host in enumerate(self.hosts):
            controls.add_node(
                PROJECT_A, ZONE, f"a{i}", external_ips=[host.ip],
                host_keys={0: {k.split()[0]: k for k in self.fleet.host_keys(host.name)}},
            )  # fmt: skip
        self.vms_a = inventory.import_vms(
            self.admin_a, self.lab_a, [f"{ZONE}/a{i}" for i in range(VMS_A)]
        )
        if any(not w.is_pinned for vm in self.vms_a for w in vm.workers.all()):
            raise RuntimeError("lab A's workers are not pinned")
        # Lab B: one connected VM whose worker's address will change (on the host and
        # in the API, as when Google moves it), and a person with access.
        self.lab_b, admin_b = lab("Lab B", "lab-b", PROJECT_B)
        host = self.host_b
        self.fleet.set_ssh_keys(
            host.name, {settings.PORTAL_LAB_SSH_USER: [lab_key(self.lab_b).public_line]}
        )
        controls.add_node(
            PROJECT_B, ZONE, "b0", external_ips=[host.ip],
            host_keys={0: {k.split()[0]: k for k in self.fleet.host_keys(host.name)}},
        )  # fmt: skip
        [vm_b] = inventory.import_vms(admin_b, self.lab_b, [f"{ZONE}/b0"])
        milo = User.objects.create_user(email="milo@uni.example", password="x" * 12)
        Membership.objects.create(
            lab=self.lab_b, user=milo, role="member", state="approved",
            policy_version_accepted=self.lab_b.policy_version, policy_accepted_at=timezone.now(),
        )  # fmt: skip
        choose_username(milo, f"milo{secrets.token_hex(2)}")
        # Active, as a finished reconcile would leave it.
        TpuVm.objects.filter(pk=vm_b.pk).update(desired_version=F("desired_version") + 1)
        vm_b.refresh_from_db()
        Grant.objects.create(user=milo, vm=vm_b, state="active", version=vm_b.desired_version)

    # --- one measurement --------------------------------------------------------------

    def _change_b(self) -> float:
        """Move lab B's worker now; seconds until the email with the new address."""
        new_ip = self.fleet.move(self.host_b.name)
        t0 = time.time()
        self.emulator.controls.set_ip("b0", 0, new_ip)
        # Without a burst it comes within a sync; a burst of waits that hold the Celery
        # worker could hold it back by up to every Connect's whole wait.
        timeout = VMS_A * self.args.connect_wait + 3 * self.args.sync
        arrived = self._email(new_ip, t0, timeout=timeout)
        if arrived is None:
            raise RuntimeError(f"no email about {new_ip}:\n" + self.stack.log("worker")[-3000:])
        return arrived - t0

    def _email(self, new_ip: str, after: float, timeout: float) -> float | None:
        """When the email naming ``new_ip`` arrived at the sink (after ``after``)."""
        sink, deadline = self.sink, time.monotonic() + timeout
        with sink._arrived:
            while True:
                for arrived, _, subject in sink.messages:
                    if arrived >= after and subject.endswith(f": {new_ip}"):
                        return arrived
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sink._arrived.wait(left)

    def quiet(self) -> float:
        time.sleep(random.uniform(0, self.args.sync))
        return self._change_b()

    def burst(self) -> float:
        from tpus.services import connect

        time.sleep(random.uniform(0, self.args.sync))
        for vm in self.vms_a:
            connect.connect_vm(self.admin_a, vm)
        return self._change_b()

    def disconnect_a(self) -> None:
        """Lab A's admin disconnects its VMs: their checks stop writing and looking."""
        from tpus.services import connect

        for vm in self.vms_a:
            connect.disconnect_vm(self.admin_a, vm)
        # A check still running sees it at its next look (≤ PORTAL_CONNECT_POLL_SECONDS).
        time.sleep(5)

    def _sync_end_after(self, after: float, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.stack.events.all():
                if e["kind"] == "task_end" and e.get("task") == SYNC_TASK and e["t"] > after:
                    return e["t"]
            time.sleep(0.2)
        return None

    def _check_tasks(self, start: float, end: float) -> tuple[int, float]:
        """Connection check tasks that started in [start, end], and the longest run."""
        events = self.stack.events.all()
        ends = {e["id"]: e["t"] for e in events if e["kind"] == "task_end"}
        runs = [
            ends.get(e["id"], end) - e["t"]
            for e in events
            if e["kind"] == "task_start" and e.get("task") == CHECK_TASK and start <= e["t"] <= end
        ]
        return len(runs), max(runs, default=0.0)

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        quiet, burst = [], []
        checks, longest = 0, 0.0
        for k in range(self.args.reps):
            quiet.append(self.quiet())
            t0 = time.time()
            burst.append(self.burst())
            n, most = self._check_tasks(t0, time.time())
            checks, longest = checks + n, max(longest, most)
            print(f"  round {k + 1}: without {quiet[-1]:.2f} s, after lab A's Connects "
                  f"{burst[-1]:.2f} s", flush=True)  # fmt: skip
            self.disconnect_a()
        target = self.args.sync + 5
        never = "answer (hosts down)" if self.args.hosts_down else "accept the key"
        print()
        print(
            f"Lab B's IP change → its email at the SMTP sink (seconds), without and right "
            f"after lab A's admin pressed Connect on {VMS_A} VMs whose workers never "
            f"{never}; sync every {self.args.sync} s, PORTAL_CONNECT_WAIT_SECONDS = "
            f"{self.args.connect_wait}, a celery worker of {os.cpu_count()} processes; "
            f"{machine()}"
        )
        print()
        rows = [
            [name, median(values), max(values), len(values), target,
             "met" if max(values) <= target else "MISSED"]
            for name, values in (("without the burst", quiet), ("after lab A's burst", burst))
        ]  # fmt: skip
        print(table(["case", "median", "max", "samples", "target (sync + 5 s)", ""], rows))
        print()
        print(
            f"connection check tasks started during the bursts: {checks}; the longest ran "
            f"{longest:.3f} s"
        )

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            if self.sink is not None:
                self.sink.stop()
            if self.emulator is not None:
                self.emulator.stop()
            if self.fleet is not None:
                self.fleet.destroy()
            shutil.rmtree(self.stack.dir, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", type=int, default=10, help="PORTAL_SYNC_SECONDS (default 10)")
    parser.add_argument("--reps", type=int, default=3, help="rounds of both cases (1..10)")
    parser.add_argument(
        "--connect-wait", type=int, default=180,
        help="PORTAL_CONNECT_WAIT_SECONDS (default 180, the portal's)",
    )  # fmt: skip
    parser.add_argument(
        "--hosts-down", action="store_true",
        help="lab A's hosts hang like dead VMs (each look waits for the SSH connect timeout)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.sync = max(5, args.sync)
    args.reps = max(1, min(args.reps, 10))
    return run_on_fleet(ConnectsBench(args))


if __name__ == "__main__":
    sys.exit(main())

"""An elastic pool on the fleet: a job waiting on an empty v4-8 pool → running on a VM
the pool made, beside the sum of its parts measured in the same run the way an admin
would meet them (a queued request with capacity there → the VM in the lab; one
reconcile giving the person their account; a job started on a free VM); and a VM the
pool made deleted once idle past its limit, within one pool pass:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.elastic [--reps 2] [--every 5] [--follow 2] [--poll 5]
                                      [--timeline] [--no-warmup]

What runs: a fleet of real sshd hosts offered to the Cloud TPU emulator as the machines
new nodes are made of, Google's guest agent in a thread of this process (each node's
``ssh-keys`` applied to its hosts), PostgreSQL and Redis (a database of this run's
own), a real ``celery worker`` and ``celery beat`` (the pool's pass every ``--every``
s, the requests' every ``--follow`` s, the job poll every ``--poll`` s). The lab gives
one person every v4-8 (a kind grant) and has its v4-8 pool on, spot, idle limit 1 min
(the shortest it takes). The job is ``sleep 600`` in ``~/jax``, a link to JAX's CPU
build that each host's /etc/skel holds (put there at the start, and on a host made new
before it is offered again), so the home the portal makes on a new VM has it.

a. elastic: the person submits a job for any v4-8 while the lab has none; timed until
   it runs on the VM the pool asked for (its request, the VM in the lab, the grant
   active, placed, running: each from the rows' own times).
b. the parts, once each in the same repetition: an admin's queued request with
   capacity there → the VM in the lab (capacity + create); the VM in the lab → the
   person's grant active (one reconcile); a job submitted while a v4-8 is free →
   running (start). Their sum is what (a) is held to.
c. shrink: every job ended, the pool's VM idle; the delay from its idle limit to its
   deletion being sent, against the pool's pass interval.

One repetition is run first and not counted (``--no-warmup`` counts it): the journey
comes first in each, so the first one alone would carry the worker processes' first
imports and connections, which its parts then find made.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from bench.common import Stack, machine, median, run_on_fleet, table
from bench.vms import Agent

JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")

PROJECT, ZONE = "bench-elastic", "us-central2-b"
RUNTIME = "tpu-ubuntu2204-base"
TIMEOUT = 240.0
IDLE_MINUTES = 1


class ElasticBench:
    def __init__(self, args):
        self.args = args
        self.stack = Stack("elastic")
        self.dir = self.stack.dir
        self.fleet = self.emulator = self.agent = None
        self.made = 0

    def start(self) -> None:
        from testfleet.fleet import Fleet
        from testfleet.guestagent import offer_hosts
        from tpus.emulator.testing import start_emulator

        # Per repetition two v4-8 (the pool's, the admin's), and machines to spare
        # while deleted ones are made new.
        hosts = 2 * (self.args.reps + int(self.args.warmup)) + 2
        print(f"starting a fleet of {hosts} sshd hosts …", flush=True)
        self.fleet = Fleet.open_free()
        self.fleet.teardown()
        self.fleet.up(hosts)
        self.emulator = start_emulator(self.dir / "tpu-emulator.json")
        offer_hosts(self.fleet, self.emulator.controls.store, sorted(self.fleet.hosts))
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
            PORTAL_ELASTIC_POOL_SECONDS=self.args.every,
            PORTAL_VM_REQUEST_POLL_SECONDS=self.args.follow,
            PORTAL_JOB_POLL_SECONDS=self.args.poll,
            PORTAL_JOB_CANCEL_GRACE_SECONDS=2,
            PORTAL_SYNC_SECONDS=3600,
            PORTAL_RECONCILE_SWEEP_SECONDS=3600,
            PORTAL_EXPIRY_CHECK_SECONDS=3600,
            PORTAL_DRIFT_CHECK_SECONDS=3600,
        )
        import logging

        logging.getLogger("tpus").setLevel(logging.WARNING)
        for host in sorted(self.fleet.hosts):
            self._link_jax(host)
        self.agent = Agent(self.fleet, self.emulator.state_file, prepare=self._link_jax)
        self._scene()
        self.agent.start()
        print("starting a celery worker and beat …", flush=True)
        self.stack.start_worker()
        self.stack.start_beat()

    def _scene(self) -> None:
        from django.utils import timezone

        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Lab, LabAllowance, Membership
        from tpus.services import elastic_admin
        from tpus.services.kind_grants import grant_kind

        self.lab = Lab.objects.create(
            name="Bench Elastic", slug="bench-elastic", gcp_project_id=PROJECT, zones=[ZONE]
        )
        LabAllowance.objects.create(lab=self.lab, generation="v4", provisioning="spot", chips=4096)
        approved = {"state": "approved", "policy_version_accepted": self.lab.policy_version,
                    "policy_accepted_at": timezone.now()}  # fmt: skip
        self.admin = User.objects.create_user(email="boss@elastic.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=self.admin, role="admin", **approved)
        self.user = User.objects.create_user(email="milo@elastic.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=self.user, role="member", **approved)
        choose_username(self.user, f"be{self.stack.tag[-4:]}")
        self.user = User.objects.select_related("unix_account").get(pk=self.user.pk)
        grant_kind(self.admin, self.lab, self.user, "v4-8", sudo=False)
        self.pool = elastic_admin.set_pool(
            self.admin, self.lab, "v4-8", enabled=True, provisioning="spot", zones=[ZONE],
            runtime_version=RUNTIME, idle_minutes=IDLE_MINUTES,
        )  # fmt: skip

    def _link_jax(self, host: str) -> None:
        """``jax`` → JAX's CPU build in the host's /etc/skel, so the home the portal makes
        for the person has ``~/jax``: on every host at the start, and on a host made new
        (an empty /etc) before it is offered again, as an image would have it."""
        script = f"mkdir -p /etc/skel && ln -sfn {JAX_ENV} /etc/skel/jax"
        self.fleet.exec(host, ["sh", "-c", script])

    # --- steps ---------------------------------------------------------------------

    def _submit(self):
        from tpus.services.jobs import JobSpec, Kind, submit_pool_job

        spec = JobSpec(args=["sleep", "600"], python="~/jax")
        return submit_pool_job(self.user, self.lab, Kind("v4-8"), spec)

    def _until(self, what: str, check, timeout: float = TIMEOUT):
        deadline = time.time() + timeout
        while not (found := check()):
            if time.time() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)
        return found

    def _running(self, job):
        from tpus.models import Job

        def look():
            row = Job.objects.get(pk=job.pk)
            if row.has_ended:
                raise RuntimeError(f"job {row.pk} ended {row.state}: {row.reason}")
            return row if row.state == "running" else None

        return self._until(f"job {job.pk} running", look)

    def _end(self, job) -> None:
        from tpus.models import Job
        from tpus.services import jobs

        jobs.cancel_job(Job.objects.get(pk=job.pk), self.user)
        self._until(f"job {job.pk} ended", lambda: Job.objects.get(pk=job.pk).has_ended)

    def elastic(self) -> tuple[float, dict, object]:
        from tpus.models import Grant, VmRequest

        job = self._submit()
        t0 = job.queued_at
        row = self._running(job)
        made = VmRequest.objects.get(vm_id=row.vm_id, elastic_pool=self.pool)
        grant = Grant.objects.get(vm_id=row.vm_id, user=self.user)
        end = row.started_at
        parts = {
            "→ pool asked": (made.created_at - t0).total_seconds(),
            "→ VM in lab": (made.ready_at - made.created_at).total_seconds(),
            "→ grant active": (grant.activated_at - made.ready_at).total_seconds(),
            "→ placed": (row.placed_at - grant.activated_at).total_seconds(),
            "→ running": (end - row.placed_at).total_seconds(),
        }
        self._timeline("elastic", t0.timestamp(), end.timestamp(), {
            "submitted": t0, "pool asked": made.created_at, "sent": made.sent_at,
            "waiting": made.waiting_since, "VM in lab": made.ready_at,
            "grant active": grant.activated_at, "placed": row.placed_at, "running": end,
        })  # fmt: skip
        return (end - t0).total_seconds(), parts, row

    def _timeline(self, what: str, start: float, end: float, rows: dict) -> None:
        """With ``--timeline``: the rows' times and every task the worker ran between
        ``start`` and ``end``, in seconds from ``start`` (what ran when, and on which
        worker process)."""
        if not self.args.timeline:
            return
        self.stack.events.wait_idle(timeout=3)
        lines = [(t.timestamp() - start, f"row  {k}") for k, t in rows.items() if t]
        for e in self.stack.events.between(start - 0.05, end + 0.05):
            if e["kind"] == "task_start":
                name = e["task"].rsplit(".", 1)[-1]
                lines.append((e["t"] - start, f"{e['pid']} > {name}{tuple(e['args'])}"))
            elif e["kind"] == "task_end":
                name = e["task"].rsplit(".", 1)[-1]
                lines.append((e["t"] - start, f"{e['pid']} < {name}"))
            elif "start" in e:
                label = e["kind"] + (f" {e['method']}" if "method" in e else "")
                lines.append((e["start"] - start, f"{e['pid']}   {label} "
                              f"{e['end'] - e['start']:.3f} s"))  # fmt: skip
        print(f"  -- {what}")
        for at, text in sorted(lines):
            print(f"  {at:7.3f}  {text}")

    def parts(self) -> dict:
        from tpus.models import Grant, VmRequest
        from tpus.services.vm_requests import VmSpec, request_vm

        self.made += 1
        spec = VmSpec(name=f"admin-{self.made}", zone=ZONE, accelerator_type="v4-8",
                      runtime_version=RUNTIME, provisioning="spot", queued=True)  # fmt: skip
        asked = request_vm(self.admin, self.lab, spec)
        made = self._until(
            "the admin's VM",
            lambda: VmRequest.objects.filter(pk=asked.pk, state="ready").first(),
        )
        grant = self._until(
            "the grant on the admin's VM",
            lambda: Grant.objects.filter(vm_id=made.vm_id, user=self.user, state="active").first(),
        )
        job = self._submit()
        row = self._running(job)
        self._timeline("parts", made.created_at.timestamp(), row.started_at.timestamp(), {
            "asked": made.created_at, "sent": made.sent_at, "waiting": made.waiting_since,
            "VM in lab": made.ready_at, "grant active": grant.activated_at,
            "submitted": row.queued_at, "placed": row.placed_at, "running": row.started_at,
        })  # fmt: skip
        self._end(row)
        return {
            "capacity + create": (made.ready_at - made.created_at).total_seconds(),
            "one reconcile": (grant.activated_at - made.ready_at).total_seconds(),
            "start": (row.started_at - row.queued_at).total_seconds(),
            "vm": made.vm_id,
        }

    def shrink(self, vm_id: int) -> float:
        """Seconds from the VM's idle limit to its deletion being sent."""
        import datetime as dt

        from tpus.models import AuditEvent
        from tpus.services import elastic_pools

        idle = [vm for vm in elastic_pools.idle_vms(self.pool) if vm.vm_id == vm_id]
        if not idle:
            raise RuntimeError("the pool's VM is not idle")
        limit = idle[0].idle_since + dt.timedelta(minutes=IDLE_MINUTES)
        event = self._until(
            "the pool's deletion",
            lambda: AuditEvent.objects.filter(action="elastic_pool.shrank", data__vm=vm_id).first(),
            timeout=IDLE_MINUTES * 60 + 3 * self.args.every + 30,
        )
        return (event.created_at - limit).total_seconds()

    def _delete_admin_vm(self, vm_id: int) -> str:
        from tpus.models import TpuVm
        from tpus.services import vm_lifecycle

        vm = TpuVm.objects.get(pk=vm_id)
        vm_lifecycle.delete_vm(self.admin, vm, vm.name)
        return vm.name

    def _quiet(self, names: set[str]) -> None:
        """Until the VMs just deleted are gone at Google and the machines they gave back
        are made new (seconds of work per host, in this process's agent thread): the
        next repetition's journey then runs as its parts do, with nothing of the last
        repetition still running beside it."""
        controls = self.emulator.controls

        def quiet() -> bool:
            nodes = controls.show().get("nodes", {})
            there = {name.rsplit("/", 1)[-1] for name in nodes}
            return not (there & names) and not controls.released_hosts()

        self._until("the deleted VMs' machines made new", quiet, timeout=TIMEOUT)

    def run(self) -> None:
        totals, sums, shrinks, rows_a, rows_b = [], [], [], [], []
        first = 0 if self.args.warmup else 1
        for rep in range(first, self.args.reps + 1):
            total, parts_a, job = self.elastic()
            self._end(job)
            parts_b = self.parts()
            delay = self.shrink(job.vm_id)
            deleted = {job.vm.name, self._delete_admin_vm(parts_b.pop("vm"))}
            self._quiet(deleted)
            base = sum(parts_b.values())
            if rep == 0:
                print(f"  warm-up (not counted): elastic {total:.2f} s, sum of parts "
                      f"{base:.2f} s", flush=True)  # fmt: skip
                continue
            totals.append(total)
            sums.append(base)
            shrinks.append(delay)
            rows_a.append(parts_a)
            rows_b.append(parts_b)
            print(f"  rep {rep}: elastic {total:.2f} s, sum of parts {base:.2f} s, "
                  f"deleted {delay:.2f} s after the idle limit", flush=True)  # fmt: skip
        rows = [["waiting job on an empty pool → running on its VM", *_spread(totals)]]
        rows += [[f"  {k}", *_spread(p[k] for p in rows_a)] for k in rows_a[0]]
        rows.append(["sum: capacity + create + one reconcile + start", *_spread(sums)])
        rows += [[f"  {k}", *_spread(p[k] for p in rows_b)] for k in rows_b[0]]
        rows.append(["idle limit → deletion sent", *_spread(shrinks)])
        print()
        print(f"machine: {machine()}")
        print(f"{self.args.reps} repetition(s); seconds; pool pass every {self.args.every} s, "
              f"request follow-up every {self.args.follow} s, job poll every "
              f"{self.args.poll} s")  # fmt: skip
        print(table(["", "median", "min", "max"], rows))
        print()
        ratio = median(totals) / median(sums)
        print(f"elastic / sum of parts = {ratio:.2f}")
        worst = max(shrinks)
        print(
            f"idle limit → deletion: worst {worst:.2f} s against a pass every "
            f"{self.args.every} s: {'within one pass' if worst <= self.args.every else 'LATE'}"
        )

    def close(self) -> None:
        try:
            if self.agent is not None:
                self.agent.stop()
            self.stack.close()
        finally:
            if self.emulator is not None:
                self.emulator.stop()
            if self.fleet is not None:
                self.fleet.destroy()
            shutil.rmtree(self.dir, ignore_errors=True)


def _spread(values) -> list[float]:
    values = list(values)
    return [median(values), min(values), max(values)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2, help="repetitions (1..10)")
    parser.add_argument("--every", type=int, default=5, help="PORTAL_ELASTIC_POOL_SECONDS")
    parser.add_argument("--follow", type=int, default=2, help="PORTAL_VM_REQUEST_POLL_SECONDS")
    parser.add_argument("--poll", type=int, default=5, help="PORTAL_JOB_POLL_SECONDS")
    parser.add_argument(
        "--timeline", action="store_true", help="print each repetition's rows and tasks in time"
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="count the first repetition too (by default one is run first and not counted: "
        "the journey, always first, would otherwise carry the worker's first imports, "
        "database and broker connections, which its parts then find made)",
    )
    args = parser.parse_args(argv)
    args.reps = max(1, min(args.reps, 10))
    return run_on_fleet(ElasticBench(args))


if __name__ == "__main__":
    sys.exit(main())

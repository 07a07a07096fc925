"""A job for any free v4-8 whose VM Google takes back: preempted → running on the other
free v4-8 of the kind, beside what one sync and one start take in the same run:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.moves [--reps 5]

What runs: two one-worker v4-8 nodes of the Cloud TPU emulator (``pool-a``, ``pool-b``)
whose workers are real sshd hosts of the test fleet, a database of this run's own, and
the portal's services in this process (the job poll's parts, called one after the other
as its tasks would run them). The job is ``sleep 600`` run again after a preemption.

- **moved**: milo's job runs on pool-a; the emulator preempts pool-a and its host goes
  off the network (connects to it hang, as to a dead cloud VM); timed from there:
  one inventory sync (it sees PREEMPTED), pool-a's pass (the job is lost, runs again at
  the head of the kind's line and is placed on pool-b), pool-b's pass (pre-flight and
  start) until the job run again is RUNNING there.
- **one sync + a start**: the same sync with nothing changed, then a job for the kind
  submitted and started on pool-b by its pass: what the move is held to.

- **moved, asking the dead VM's workers first**: once, the same move with the pass
  asking pool-a's workers before it ends the job (``PORTAL_REMOTE_CONNECT_TIMEOUT`` is
  5 s here): what a pass that does not trust PREEMPTED costs.

Between repetitions pool-a is made READY again and synced (untimed). One untimed
warm-up first. Target: moved ≤ one sync + a start, plus the lost VM's own pass (which
asks no worker of a preempted VM).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.common import machine, median, table
from bench.jobs import ZONE, Bench

PROJECT = "bench-jobs"
HEADERS = ["", "median", "min", "max"]


class MoveBench(Bench):
    """Two VMs of one kind (``Bench`` keys its VMs by size: this scene is its own)."""

    def _scene(self) -> None:
        from django.conf import settings
        from django.utils import timezone

        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Lab, Membership
        from tpus.services import inventory
        from tpus.services.grants import grant_access
        from tpus.services.labkeys import lab_key
        from tpus.services.reconcile import reconcile_vm

        self.lab = Lab.objects.create(
            name="Bench Moves", slug="bench-moves", gcp_project_id=PROJECT, zones=[ZONE]
        )
        key = lab_key(self.lab)
        for host in self.hosts:
            self.fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [key.public_line]})
        approved = {"state": "approved", "policy_version_accepted": self.lab.policy_version,
                    "policy_accepted_at": timezone.now()}  # fmt: skip
        self.admin = User.objects.create_user(email="boss@moves.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=self.admin, role="admin", **approved)
        for name, host in zip(("pool-a", "pool-b"), self.hosts, strict=True):
            self.emulator.controls.add_node(
                PROJECT, ZONE, name, accelerator_type="v4-8", workers=1,
                internal_ips=[host.ip], external_ips=[host.ip],
                host_keys={0: {k.split()[0]: k for k in self.fleet.host_keys(host.name)}},
            )  # fmt: skip
        vms = inventory.import_vms(self.admin, self.lab, [f"{ZONE}/pool-a", f"{ZONE}/pool-b"])
        self.a, self.b = sorted(vms, key=lambda vm: vm.name)
        name = f"bm{self.tag}"
        user = User.objects.create_user(email=f"{name}@moves.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=user, role="member", **approved)
        choose_username(user, name)
        grants = grant_access(self.admin, self.lab, user, [self.a, self.b], sudo=False)
        for vm in (self.a, self.b):
            reconcile_vm(vm.pk)
        for grant in grants:
            grant.refresh_from_db()
            if grant.state != "active":
                raise RuntimeError(f"the grant on {grant.vm.name} is {grant.state}: {grant.error}")
        self.user = User.objects.select_related("unix_account").get(pk=user.pk)
        home = f"/home/{self.user.unix_account.username}"
        for host in self.hosts:
            self.fleet.exec(host.name, ["sh", "-c", f"ln -sfn {JAX_ENV} {home}/jax && "
                                        f"chown -h {self.user.unix_account.username}: "
                                        f"{home}/jax"])  # fmt: skip

    def _time_fanouts(self) -> None:
        """Nothing to split: the figures here are whole."""

    def pool_job(self):
        from tpus.services.jobs import JobSpec, Kind, submit_pool_job

        spec = JobSpec(args=["sleep", "600"], python="~/jax", rerun_after_preemption=True)
        return submit_pool_job(self.user, self.lab, Kind("v4-8"), spec)

    def _running(self, job, vm) -> None:
        from tpus.services import job_engine

        job_engine.advance(vm.pk)
        job.refresh_from_db()
        if job.state != "running" or job.vm_id != vm.pk:
            raise RuntimeError(f"job {job.pk} is {job.state} on {job.vm_id}: {job.reason}")

    def _stop(self, job) -> None:
        from tpus.services import job_engine, jobs

        jobs.cancel_job(job, self.user)
        job_engine.advance(job.vm_id)
        job.refresh_from_db()
        if not job.has_ended:
            raise RuntimeError(f"job {job.pk} did not stop: {job.state}")

    def _a_is_back(self) -> None:
        from tpus.services import scheduler, sync
        from tpus.services.reconcile import reconcile_vm

        # The machine comes back new: on the network, without the lost job's processes.
        self.fleet.start(self.hosts[0].name)
        self.fleet.reboot(self.hosts[0].name)
        self.emulator.controls.end_maintenance("pool-a", external_ips=[self.hosts[0].ip])
        sync.sync_inventory([self.lab])
        reconcile_vm(self.a.pk)
        self.a.refresh_from_db()
        free = {vm.id for vm in scheduler.load(self.lab.pk, every_vm=False).vms}
        if self.a.state != "READY" or (free and self.a.pk not in free):
            raise RuntimeError(f"pool-a is not free again: {self.a.state}")

    def moved(self) -> tuple[float, dict]:
        from tpus.models import Job
        from tpus.services import job_engine, sync

        job = self.pool_job()
        job.refresh_from_db()
        self._running(job, self.a)
        # Google takes pool-a back: the emulator says PREEMPTED and its machine is off
        # the network (connects hang, as to a dead cloud VM).
        self.emulator.controls.preempt("pool-a")
        self.fleet.down(self.hosts[0].name, hang=True)
        t0 = time.perf_counter()
        sync.sync_inventory([self.lab])
        t1 = time.perf_counter()
        job_engine.advance(self.a.pk)
        t2 = time.perf_counter()
        again = Job.objects.filter(rerun_of=job).first()
        if again is None or again.vm_id != self.b.pk:
            raise RuntimeError(f"job {job.pk} was not moved to pool-b: {job.reason}")
        self._running(again, self.b)
        t3 = time.perf_counter()
        self._stop(again)
        self._a_is_back()
        return t3 - t0, {"sync": t1 - t0, "lost pass": t2 - t1, "start": t3 - t2}

    def sync_and_start(self) -> tuple[float, dict]:
        from tpus.services import sync

        busy = self.pool_job()  # pool-a is taken, so the timed job goes to pool-b
        busy.refresh_from_db()
        t0 = time.perf_counter()
        sync.sync_inventory([self.lab])
        t1 = time.perf_counter()
        job = self.pool_job()
        job.refresh_from_db()
        self._running(job, self.b)
        t2 = time.perf_counter()
        self._stop(job)
        from tpus.models import Job

        Job.objects.filter(pk=busy.pk).update(state="cancelled", ended_at=busy.queued_at)
        return t2 - t0, {"sync": t1 - t0, "start": t2 - t1}

    def run(self) -> None:
        self.moved()
        self.sync_and_start()
        moved, plain, moved_parts, plain_parts = [], [], [], []
        for rep in range(1, self.args.reps + 1):
            elapsed, parts = self.moved()
            moved.append(elapsed)
            moved_parts.append(parts)
            elapsed, parts = self.sync_and_start()
            plain.append(elapsed)
            plain_parts.append(parts)
            print(f"  rep {rep}: moved {moved[-1]:.3f} s, one sync + a start {plain[-1]:.3f} s",
                  flush=True)  # fmt: skip
        rows = [
            ["preempted → running on the other v4-8", median(moved), min(moved), max(moved)],
            ["  of which the sync", *_spread(p["sync"] for p in moved_parts)],
            ["  of which the lost VM's pass", *_spread(p["lost pass"] for p in moved_parts)],
            ["  of which the start on the other VM", *_spread(p["start"] for p in moved_parts)],
            ["one sync + a start", median(plain), min(plain), max(plain)],
            ["  of which the sync", *_spread(p["sync"] for p in plain_parts)],
            ["  of which the start", *_spread(p["start"] for p in plain_parts)],
        ]
        # Once, for comparison: the same move when the lost VM's pass first asks its
        # workers (as it did before it knew a preempted VM's machines are gone).
        from tpus.services import job_engine

        kept, job_engine.TAKEN_STATES = job_engine.TAKEN_STATES, set()
        try:
            asking, asking_parts = self.moved()
        finally:
            job_engine.TAKEN_STATES = kept
        rows.append(["moved, asking the dead VM's workers first (once)", asking, asking, asking])
        rows.append(["  of which the lost VM's pass", *[asking_parts["lost pass"]] * 3])
        ratio = median(moved) / median(plain)
        lost = median(p["lost pass"] for p in moved_parts)
        print()
        print(f"machine: {machine()}")
        print(f"{self.args.reps} repetition(s) after one untimed warm-up; seconds")
        print(table(HEADERS, rows))
        print()
        print(f"moved / (one sync + a start) = {ratio:.2f}; target ≤ 1 plus the lost VM's "
              f"pass ({(median(plain) + lost) / median(plain):.2f}): "
              f"{'met' if median(moved) <= median(plain) + lost else 'MISSED'}")  # fmt: skip


def _spread(values) -> list[float]:
    values = list(values)
    return [median(values), min(values), max(values)]


JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (1..20)")
    args = parser.parse_args(argv)
    args.reps = max(1, min(args.reps, 20))
    # What ``Bench`` reads: two one-worker hosts, the poll and grace as in production.
    args.sizes, args.poll, args.grace = [1, 1], 5, 10
    if os.geteuid() != 0:
        print("the fleet needs root (network namespaces)", file=sys.stderr)
        return 2
    bench = MoveBench(args)
    try:
        bench.start()
        bench.run()
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A job that carries its workdir: queued → running on every worker, beside the same job
without a workdir, in the same run:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.snapshots [--workers 4] [--files 200] [--mb 20] [--reps 5]

What runs: one v4-N node of the Cloud TPU emulator whose workers are real sshd hosts of
the test fleet, a database of this run's own, the snapshot storage on local disk, and
the job's pass in this process (``job_engine.advance``, as its task would run it). The
job is ``sleep 600``, stopped (untimed) after each start.

- **plain**: the job without a workdir.
- **cold cache**: with a workdir of ``--files`` files (``--mb`` MB in all), every
  worker's cache removed first: each worker is sent every content.
- **one file changed**: a snapshot of the same workdir with one file's content
  changed, the caches warm: each worker is sent that one content.

Target: a run again after one changed file adds little to a job's start (its ratio to
plain close to 1).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import time

from bench.common import machine, median, table
from bench.jobs import ZONE, Bench

PROJECT = "bench-snapshots"
HEADERS = ["", "median", "min", "max", "× plain"]
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")


class SnapshotBench(Bench):
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

        workers = self.args.workers
        self.lab = Lab.objects.create(
            name="Bench Snapshots", slug="bench-snapshots", gcp_project_id=PROJECT, zones=[ZONE]
        )
        key = lab_key(self.lab)
        for host in self.hosts:
            self.fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [key.public_line]})
        approved = {"state": "approved", "policy_version_accepted": self.lab.policy_version,
                    "policy_accepted_at": timezone.now()}  # fmt: skip
        admin = User.objects.create_user(email="boss@snapshots.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=admin, role="admin", **approved)
        self.emulator.controls.add_node(
            PROJECT, ZONE, "snap", accelerator_type=f"v4-{8 * workers}", workers=workers,
            internal_ips=[h.ip for h in self.hosts], external_ips=[h.ip for h in self.hosts],
            host_keys={
                i: {k.split()[0]: k for k in self.fleet.host_keys(h.name)}
                for i, h in enumerate(self.hosts)
            },
        )  # fmt: skip
        [self.vm] = inventory.import_vms(admin, self.lab, [f"{ZONE}/snap"])
        name = f"bs{self.tag}"
        user = User.objects.create_user(email=f"{name}@snapshots.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=user, role="member", **approved)
        choose_username(user, name)
        [grant] = grant_access(admin, self.lab, user, [self.vm], sudo=False)
        reconcile_vm(self.vm.pk)
        grant.refresh_from_db()
        if grant.state != "active":
            raise RuntimeError(f"the grant is {grant.state}: {grant.error}")
        self.user = User.objects.select_related("unix_account").get(pk=user.pk)
        self.home = f"/home/{name}"
        for host in self.hosts:
            self.fleet.exec(host.name, ["sh", "-c", f"ln -sfn {JAX_ENV} {self.home}/jax && "
                                        f"chown -h {name}: {self.home}/jax"])  # fmt: skip
        size = max(1, self.args.mb * 2**20 // self.args.files)
        self.files = {
            f"src/m{i // 50}/f{i}.py": self.rng.randbytes(size) for i in range(self.args.files)
        }

    def _time_fanouts(self) -> None:
        """Nothing to split: the figures here are whole."""

    def _snapshot(self, files: dict[str, bytes]):
        from tpus.services import snapshots

        manifest = []
        for path, content in files.items():
            sha = hashlib.sha256(content).hexdigest()
            snapshots.store_blob(self.user, self.lab, sha, io.BytesIO(content), len(content))
            manifest.append({"path": path, "size": len(content), "mode": 0o644, "sha256": sha})
        return snapshots.create_snapshot(self.user, self.lab, manifest)[0]

    def _start(self, snapshot=None) -> float:
        from tpus.services import job_engine, jobs

        spec = jobs.JobSpec(
            args=["sleep", "600"], python="~/jax", cwd="~/proj",
            snapshot=snapshot.pk if snapshot else None,
        )  # fmt: skip
        job = jobs.submit_job(self.user, self.vm, spec)
        t0 = time.perf_counter()
        job_engine.advance(self.vm.pk)
        elapsed = time.perf_counter() - t0
        job.refresh_from_db()
        if job.state != "running":
            raise RuntimeError(f"job {job.pk} is {job.state}: {job.reason}")
        jobs.cancel_job(job, self.user)
        job_engine.advance(self.vm.pk)
        return elapsed

    def _cold(self) -> None:
        for host in self.hosts:
            self.fleet.exec(host.name, ["rm", "-rf", f"{self.home}/.cache/tpu-portal",
                                        f"{self.home}/proj"])  # fmt: skip

    def run(self) -> None:
        base = self._snapshot(self.files)
        self._start()  # untimed warm-up
        plain, cold, changed = [], [], []
        for rep in range(1, self.args.reps + 1):
            plain.append(self._start())
            self._cold()
            cold.append(self._start(base))
            edited = dict(self.files)
            edited["src/m0/f0.py"] = self.rng.randbytes(len(self.files["src/m0/f0.py"]))
            changed.append(self._start(self._snapshot(edited)))
            print(f"  rep {rep}: plain {plain[-1]:.3f} s, cold {cold[-1]:.3f} s, "
                  f"one file changed {changed[-1]:.3f} s", flush=True)  # fmt: skip
        p = median(plain)
        rows = [
            ["plain (no workdir)", p, min(plain), max(plain), 1.0],
            [f"cold cache ({self.args.files} files, {self.args.mb} MB to each worker)",
             median(cold), min(cold), max(cold), median(cold) / p],
            ["one file changed (warm caches)", median(changed), min(changed), max(changed),
             median(changed) / p],
        ]  # fmt: skip
        print()
        print(f"machine: {machine()}")
        print(f"{self.args.workers} worker(s); {self.args.reps} repetition(s) after one untimed "
              "warm-up; seconds from queued to running on every worker (one pass)")  # fmt: skip
        print(table(HEADERS, rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="workers of the VM (1..32)")
    parser.add_argument("--files", type=int, default=200, help="files of the workdir")
    parser.add_argument("--mb", type=int, default=20, help="MB of the workdir in all")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (1..20)")
    args = parser.parse_args(argv)
    args.reps = max(1, min(args.reps, 20))
    args.workers = max(1, min(args.workers, 32))
    args.files = max(1, min(args.files, 10_000))
    args.sizes, args.poll, args.grace = [args.workers], 5, 0
    if os.geteuid() != 0:
        print("the fleet needs root (network namespaces)", file=sys.stderr)
        return 2
    bench = SnapshotBench(args)
    try:
        bench.start()
        bench.run()
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

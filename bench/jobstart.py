"""A job's start on a pod as a person sees it, through the portal's API, beside the
plain ssh loops a person would write:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.jobstart [--sizes 4,32] [--reps 5]

- **portal**: ``POST /api/v1/labs/{slug}/vms/{vm}/jobs`` (``sleep 600`` with the
  person's JAX environment, so the pre-flight reads its versions) with the person's API
  token, to a live portal (gunicorn on 127.0.0.1, the test settings on PostgreSQL and
  Redis) and a real ``celery worker`` (prefork, as the README runs it); then
  ``GET /api/v1/me/jobs/{id}`` until it says ``running``: asked as soon as PostgreSQL
  reports that a change of the job's state committed (a NOTIFY, as ``bench.jobs``
  reads them), and every 50 ms after that until the answer says so. Timed from the
  submit's answer to the first answer that says ``running`` (``submit`` is the POST
  itself). (A poll every 50 ms from the submit on made the answer late by up to a
  poll, and its requests took the CPU the fleet's hosts were starting the job with.)
  Then, untimed: the last worker runs ``sleep`` under the pid the portal recorded, and
  the job is cancelled through the API and has ended before the next sample.
- **serial ssh**: plain OpenSSH as the person (his own key, the known_hosts the portal
  gives him), one worker after the other, each starting ``sleep 600`` in the background
  (``nohup … &``) and returning: no pre-flight, no cgroup, no log; what a person
  types is a floor for it.
- **parallel ssh**: the same command with one ``ssh`` per worker all started at once,
  waiting for the last.

One untimed warm-up of each way per size first (the portal's then opens the SSH
connections its worker processes keep, ``PORTAL_REMOTE_KEEP_SECONDS``; OpenSSH has no
shared connection here, as a person's loop has none unless configured), then the
repetitions in turn, the three ways side by side. The cold figure is the warm-up's.
Nothing leaves the machine. Targets (DESIGN.md): ≤ 1 s on 4 workers; on 32,
≤ 0.1× the serial loop and faster than the parallel ssh.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.common import machine, median, run_on_fleet, table
from bench.jobs import Bench
from bench.provision import SSH_OPTIONS

POLL_SECONDS = 0.05
# The job's states the API is asked at (the commit that makes it running, or an end).
WAIT_STATES = {"running", "cancelling", "succeeded", "failed", "cancelled", "lost", "rejected"}
COMMAND = "nohup sleep 600 >/dev/null 2>&1 </dev/null &"


class StartBench(Bench):
    def start(self) -> None:
        super().start()
        from django.db import transaction

        from accounts.services import create_token
        from bench.cli import CliBench

        with transaction.atomic():
            _, self.token = create_token(self.user, "bench start")
        self.stack.start_worker()
        self.url = CliBench._start_portal(self)
        import httpx

        self.http = httpx.Client(
            base_url=self.url + "/api/v1",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.user_key = self.dir / f"id_bj{self.tag}"  # the person's own (bench.jobs)

    # --- the portal, through its API ---------------------------------------------------

    def portal(self, size: int, *, kind: bool = False) -> tuple[float, float]:
        """(submit's answer → API says running, the submit's own time). With ``kind``,
        submitted to any free VM of the VM's kind (the lab's pool), where it is the only
        one of its kind, rather than to the VM by name."""
        vm = self.vms[size]
        body = {"args": ["sleep", "600"], "python": "~/jax"}
        path = f"/labs/{self.lab.slug}/vms/{vm.pk}/jobs"
        if kind:
            body["accelerator_type"] = vm.accelerator_type
            path = f"/labs/{self.lab.slug}/jobs"
        sent = time.time()
        t0 = time.perf_counter()
        answer = self.http.post(path, json=body)
        t1 = time.perf_counter()
        wall = time.time()
        if answer.status_code != 201:
            raise RuntimeError(f"submit: {answer.status_code} {answer.text[:500]}")
        job_id = answer.json()["id"]
        # Asked once PostgreSQL says the job's state changed to one it ends the wait in
        # (nothing is asked while the pass works), then every POLL_SECONDS.
        waited, _ = self.states.wait(job_id, WAIT_STATES, time.time() + 120)
        if waited is None:
            raise RuntimeError(f"job {job_id} is not running after 120 s")
        while True:
            seen = self.http.get(f"/me/jobs/{job_id}").json()
            if seen["state"] == "running":
                t2 = time.perf_counter()
                if seen["vm_id"] != vm.pk:
                    raise RuntimeError(f"job {job_id} runs on VM {seen['vm_id']}, not {vm.pk}")
                self.phases.append(self._phases(vm.pk, sent, wall, wall + (t2 - t1)))
                break
            if seen["state"] in {"succeeded", "failed", "cancelled", "lost", "rejected"}:
                raise RuntimeError(f"job {job_id} {seen['state']}: {seen.get('reason')}")
            if time.perf_counter() - t1 > 120:
                raise RuntimeError(f"job {job_id} is still {seen['state']} after 120 s")
            time.sleep(POLL_SECONDS)
        self._after(size, job_id)
        return t2 - t1, t1 - t0

    def _phases(self, vm_id: int, sent: float, answered: float, seen: float) -> dict:
        """Where the time from the submit's answer to the API's ``running`` went, from
        the worker's probes (``bench.celeryapp``; wall clock, as this process's)."""
        self.stack.events.wait_idle(timeout=10, settle=0.1)
        # The task may start before the POST's answer is back (it is queued at commit).
        events = [e for e in self.stack.events.all() if e.get("start", e.get("t", 0)) >= sent]
        pre = next(e for e in events if e["kind"] == "job_preflight" and e["vm"] == vm_id)
        task = [e for e in events if e["kind"] == "task_start" and e["args"] == [vm_id]
                and e["t"] <= pre["start"]][-1]  # fmt: skip
        go = next(e for e in events if e["kind"] == "job_go" and e["start"] >= pre["end"])
        end = next(e for e in events if e["kind"] == "task_end" and e["id"] == task["id"])
        return {
            "pickup": task["t"] - answered,
            "until pre-flight": pre["start"] - task["t"],
            "pre-flight": pre["end"] - pre["start"],
            "between": go["start"] - pre["end"],
            "start": go["end"] - go["start"],
            "commit": end["t"] - go["end"],
            "seen": seen - end["t"],
        }

    def _after(self, size: int, job_id: int) -> None:
        """Untimed: the last worker runs the job's process; cancel it and wait for its end."""
        from tpus.models import Job

        job = Job.objects.get(pk=job_id)
        parts = list(job.parts.order_by("index"))
        if [p.state for p in parts] != ["running"] * size:
            raise RuntimeError(f"job {job_id}: {[p.state for p in parts]}")
        self._check_alive(self.vm_hosts[size][-1], parts[-1].pid)
        done = self.http.post(f"/labs/{self.lab.slug}/vms/{job.vm_id}/jobs/{job_id}/cancel")
        if done.status_code >= 300:
            raise RuntimeError(f"cancel: {done.status_code} {done.text[:300]}")
        deadline = time.monotonic() + 120
        while not job.has_ended:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not end: {job.state}")
            time.sleep(0.1)
            job.refresh_from_db(fields=["state", "ended_at"])

    # --- plain ssh ----------------------------------------------------------------------

    def _argv(self, host) -> list[str]:
        return [
            "ssh", *SSH_OPTIONS, "-i", str(self.user_key),
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            f"{self.username}@{host.ip}", COMMAND,
        ]  # fmt: skip

    def serial(self, size: int) -> float:
        began = time.perf_counter()
        for host in self.vm_hosts[size]:
            subprocess.run(self._argv(host), check=True, capture_output=True, timeout=60)
        took = time.perf_counter() - began
        self._stop_sleeps(size)
        return took

    def parallel(self, size: int) -> float:
        began = time.perf_counter()
        procs = [
            subprocess.Popen(self._argv(h), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for h in self.vm_hosts[size]
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            if proc.returncode != 0:
                raise RuntimeError(f"parallel ssh: {err.decode()[-300:]}")
        took = time.perf_counter() - began
        self._stop_sleeps(size)
        return took

    def _stop_sleeps(self, size: int) -> None:
        for host in self.vm_hosts[size]:
            self.fleet.exec(host.name, ["pkill", "-KILL", "-u", self.username, "-x", "sleep"],
                            check=False)  # fmt: skip

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        rows, detail, phases = [], [], []
        self.phases = []
        for size in self.args.sizes:
            cold, _ = self.portal(size)
            self.portal(size)  # the other worker process's connections
            self.serial(size)
            self.parallel(size)
            portal, submits, serial, parallel = [], [], [], []
            self.phases = []
            for rep in range(1, self.args.reps + 1):
                took, submit = self.portal(size)
                portal.append(took)
                submits.append(submit)
                serial.append(self.serial(size))
                parallel.append(self.parallel(size))
                print(
                    f"  {size:>2} workers, rep {rep}: portal {portal[-1]:.3f} s, serial ssh "
                    f"{serial[-1]:.3f} s, parallel ssh {parallel[-1]:.3f} s",
                    flush=True,
                )
            p, s, q = median(portal), median(serial), median(parallel)
            if size <= 4:
                verdict = "met" if p <= 1.0 else "MISSED"
            else:
                verdict = "met" if p <= 0.1 * s and p < q else "MISSED"
            rows.append([size, p, min(portal), max(portal), s, q, p / s, p / q, verdict])
            names = list(self.phases[0])
            phases.append([size, *(median(x[n] for x in self.phases) for n in names)])
            detail.append([size, cold, median(submits)])
        print()
        print(f"machine: {machine()}")
        print(f"sizes {self.args.sizes}, {self.args.reps} repetitions after one untimed "
              "warm-up of each way")  # fmt: skip
        print()
        print(
            "submit's answer → the API says running (seconds; the API asked once PostgreSQL "
            "reported the commit, then every 50 ms; job = `sleep 600` with a pre-flight of "
            "the person's JAX environment)"
        )
        headers = ["workers", "portal", "min", "max", "serial ssh", "parallel ssh",
                   "portal/serial", "portal/parallel", "target"]  # fmt: skip
        print(table(headers, rows))
        print()
        print("targets: ≤ 1 s on 4 workers; on more, ≤ 0.1× serial ssh and below parallel ssh")
        print()
        print(table(["workers", "first start (cold, warm-up)", "the submit POST itself"], detail))
        print()
        print("where the portal's time went (medians, seconds, from the worker's probes): the "
              "task's pickup, its pass until the pre-flight, the pre-flight until the last worker "
              "answered, between that and the word to start, the start round, the pass's end "
              "after it (commit), and the API's next answer after the pass ended")  # fmt: skip
        print(table(["workers", "pickup", "→ pre-flight", "pre-flight", "between", "start",
                     "commit", "seen"], phases))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,32", help="workers per pod (default 4,32)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per size (1..20)")
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.reps = max(1, min(args.reps, 20))
    args.poll, args.grace = 5, 1  # the shared scene's settings; no beat runs here
    return run_on_fleet(StartBench(args))


if __name__ == "__main__":
    sys.exit(main())

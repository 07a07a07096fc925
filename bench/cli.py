"""The command-line client on pods of 4 and 32 workers, beside the plain loops a
person would write:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.cli [--sizes 4,32] [--reps 3] [--parts run,exec] [--long-runtime]

1. `tpu run VM --workdir W --detach -- sleep 600` with W = 500 files, 50 MB: the
   first sync (a new folder on the workers) and a re-run after one file changed, from
   the command's start to the job RUNNING in the database (the client syncs every
   worker at once, then submits; a real Celery worker runs the job's pass). Beside it,
   a serial loop from the same laptop: `rsync` of W to each worker in turn, then `ssh`
   to each worker in turn starting the command (no pre-flight: the loop's figure is a
   floor for doing it by hand).
2. `tpu exec VM --worker all true` beside `for w in workers: ssh w true`: first with
   the client's shared ssh connections closed (it opens one per worker), then again.
3. (`--parts pool`) `tpu run --type v4-N --workdir W --detach -- sleep 600`: W goes to
   the portal as a snapshot, placed by the portal on the VM's workers, beside `tpu run
   VM --workdir W` (rsync), each with W new (nothing stored, no cache has it) and again
   after one file changed, to RUNNING; with where --type's time went.

Everything runs as the collaborator from a laptop of his own (tests.laptop: a home of
its own for the real ssh client), with the ssh config `tpu config install` wrote, a
live portal (gunicorn on 127.0.0.1) and the sshd fleet; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import PYTHON, ROOT, machine, median, table
from bench.jobs import Bench

# The client of this checkout, whichever copy the Python has installed.
TPU = ["env", f"PYTHONPATH={ROOT / 'cli'}", PYTHON, "-m", "tpu_cli"]
FILES, SIZE = 500, 50 * 1024 * 1024


class CliBench(Bench):
    def start(self) -> None:
        super().start()
        from django.db import transaction

        from accounts.services import create_token
        from tests.laptop import ClientLaptop

        self.laptop = ClientLaptop(self.dir / "home")
        if self.args.long_runtime:
            # As long as /run/user/<a 10-digit uid>: too long a folder for the sockets, so
            # the client shares its connections from a short private folder in /tmp.
            self.laptop.runtime = tempfile.mkdtemp(prefix="run-user-1234567890-", dir="/tmp")
            atexit.register(shutil.rmtree, self.laptop.runtime, ignore_errors=True)
        key = self.dir / f"id_{self.user.email.split('@')[0]}"
        shutil.copy(key, self.laptop.path("~/.ssh/id_ed25519"))
        with transaction.atomic():
            _, self.token = create_token(self.user, "bench laptop")
        self.stack.start_worker()
        self.stack.start_beat()
        self.url = self._start_portal()
        self.tpu_ok(
            "sh", "-c", f"echo {self.token} | {shlex.join(TPU)} login --with-token {self.url}"
        )
        self.tpu_ok(*TPU, "config", "install")
        self.workdir = self.laptop.path("~/work")
        self.workdir.mkdir()
        for n in range(FILES):
            (self.workdir / f"part{n:03d}.bin").write_bytes(os.urandom(SIZE // FILES))

    def _start_portal(self) -> str:
        from tests.e2e import free_port

        port = free_port()
        log = open(self.dir / "gunicorn.log", "w")
        proc = subprocess.Popen(
            [PYTHON, "-m", "gunicorn", "portal.wsgi", "-b", f"127.0.0.1:{port}", "-w", "2",
             "--access-logfile", "-", "--access-logformat", "%(m)s %(U)s %(s)s %(L)s"],
            cwd=ROOT, env={**os.environ, **self.stack.env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.stack.processes.append(("gunicorn", proc, log))
        url = f"http://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/api/v1/me", timeout=10)
                return url
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((self.dir / "gunicorn.log").read_text()[-2000:]) from None
                time.sleep(0.2)

    def tpu_ok(self, *argv: str, timeout: float = 600):
        done = self.laptop.run(list(argv), cwd=self.laptop.real_home, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{argv}: {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    # --- 1. tpu run ------------------------------------------------------------------------

    def tpu_run(self, size: int, folder: str) -> float:
        from tpus.models import Job
        from tpus.services import jobs

        began = time.perf_counter()
        done = self.tpu_ok(*TPU, "run", f"jobs{size}", "--workdir", folder, "--venv", "~/jax",
                           "--detach", "--json", "--", "sleep", "600")  # fmt: skip
        job = Job.objects.get(pk=json.loads(done.stdout)["id"])
        while job.state != "running":
            if job.has_ended:
                raise RuntimeError(f"job {job.pk}: {job.state} {job.reason}")
            time.sleep(0.01)
            job.refresh_from_db(fields=["state", "reason", "ended_at"])
        took = time.perf_counter() - began
        jobs.cancel_job(job, self.user)
        deadline = time.monotonic() + 120
        while not job.has_ended and time.monotonic() < deadline:
            time.sleep(0.2)
            job.refresh_from_db(fields=["state"])
        return took

    def serial_run(self, size: int, folder: str) -> float:
        ssh = "ssh -o BatchMode=yes"
        hosts = [f"jobs{size}-w{i}" for i in range(size)]
        local = shlex.quote(str(self.laptop.real_home) + f"/{folder}/")
        script = "\n".join(
            [f"rsync -a -e {shlex.quote(ssh)} {local} {h}:{folder}/ || exit 1" for h in hosts]
            + [f"{ssh} {h} 'cd {folder} && (nohup sleep 1 >/dev/null 2>&1 &)' || exit 1"
               for h in hosts]
        )  # fmt: skip
        began = time.perf_counter()
        self.tpu_ok("sh", "-c", script)
        return time.perf_counter() - began

    def touch_one(self, folder: str) -> None:
        changed = self.laptop.path(f"~/{folder}/part250.bin")
        changed.write_bytes(os.urandom(SIZE // FILES))

    def part_run(self) -> list[str]:
        rows = []
        for size in self.args.sizes:
            first, again, s_first, s_again = [], [], [], []
            for rep in range(self.args.reps):
                for runner, firsts, agains, name in (
                    (self.tpu_run, first, again, f"tpu{size}r{rep}"),
                    (self.serial_run, s_first, s_again, f"ser{size}r{rep}"),
                ):
                    self.tpu_ok("cp", "-a", str(self.laptop.real_home) + "/work",
                                str(self.laptop.real_home) + f"/{name}")  # fmt: skip
                    firsts.append(runner(size, name))
                    self.touch_one(name)
                    agains.append(runner(size, name))
                print(f"  {size} workers, repetition {rep + 1}: tpu {first[-1]:.2f}/"
                      f"{again[-1]:.2f} s, serial {s_first[-1]:.2f}/{s_again[-1]:.2f} s",
                      flush=True)  # fmt: skip
            first_ratio = median(first) / median(s_first)
            again_ratio = median(again) / median(s_again)
            rows.append([size, median(first), median(s_first), first_ratio,
                         median(again), median(s_again), again_ratio])  # fmt: skip
        headers = ["workers", "tpu run: first sync → running", "serial rsync+ssh", "ratio",
                   "tpu run: 1 file changed → running", "serial", "ratio"]  # fmt: skip
        return table(headers, rows)

    # --- 3. tpu run --type (a snapshot) beside tpu run VM (rsync) ------------------------

    def fresh_workdir(self, name: str) -> None:
        """A workdir of FILES files, SIZE bytes, of random bytes nobody stored yet (so
        the portal has none of its contents and no worker's cache does)."""
        folder = self.laptop.path(f"~/{name}")
        folder.mkdir()
        for n in range(FILES):
            (folder / f"part{n:03d}.bin").write_bytes(os.urandom(SIZE // FILES))

    def pool_run(self, size: int, folder: str, profile: str = "") -> tuple[float, float, float]:
        """``tpu run --type v4-N --workdir folder --detach`` until RUNNING: (seconds to
        running, seconds of the command itself, seconds of its snapshot step). With
        ``profile``, the client runs under cProfile, its statistics written there."""
        from tpus.models import Job
        from tpus.services import jobs

        began = time.perf_counter()
        argv = ["run", "--type", f"v4-{8 * size}", "--workdir", folder, "--venv", "~/jax",
                "--detach", "--json", "--", "sleep", "600"]  # fmt: skip
        tpu = [*TPU[:3], "-m", "cProfile", "-o", profile, *TPU[3:]] if profile else TPU
        done = self.tpu_ok(*tpu, *argv)
        command = time.perf_counter() - began
        job = Job.objects.get(pk=json.loads(done.stdout)["id"])
        while job.state != "running":
            if job.has_ended:
                raise RuntimeError(f"job {job.pk}: {job.state} {job.reason}")
            time.sleep(0.01)
            job.refresh_from_db(fields=["state", "reason", "ended_at"])
        took = time.perf_counter() - began
        said = re.search(r"the portal had the rest; ([\d.]+) s\.", done.stderr)
        jobs.cancel_job(job, self.user)
        deadline = time.monotonic() + 120
        while not job.has_ended and time.monotonic() < deadline:
            time.sleep(0.2)
            job.refresh_from_db(fields=["state"])
        return took, command, float(said[1]) if said else float("nan")

    def part_pool(self) -> str:
        rows, parts = [], []
        for size in self.args.sizes:
            cold, s_cold, again, s_again = [], [], [], []
            steps = {"cold": [], "again": []}
            for rep in range(self.args.reps):
                # Which way goes first alternates; each has a folder of new contents.
                ways = [("pool", f"pool{size}r{rep}"), ("rsync", f"rsync{size}r{rep}")]
                for way, name in ways if rep % 2 == 0 else ways[::-1]:
                    self.fresh_workdir(name)
                    if way == "pool":
                        took, command, snap = self.pool_run(size, name)
                        cold.append(took)
                        steps["cold"].append((command, snap))
                        self.touch_one(name)
                        profile = str(self.dir / "client.prof") if self.args.profile else ""
                        took, command, snap = self.pool_run(size, name, profile)
                        if profile:
                            self.print_profile(profile)
                        again.append(took)
                        steps["again"].append((command, snap))
                    else:
                        s_cold.append(self.tpu_run(size, name))
                        self.touch_one(name)
                        s_again.append(self.tpu_run(size, name))
                print(f"  {size} workers, repetition {rep + 1}: --type {cold[-1]:.2f}/"
                      f"{again[-1]:.2f} s, by name (rsync) {s_cold[-1]:.2f}/{s_again[-1]:.2f} s",
                      flush=True)  # fmt: skip
            rows.append([size, median(again), median(s_again), median(again) / median(s_again),
                         "met" if median(again) <= 1.5 else "missed",
                         median(cold), median(s_cold), median(cold) / median(s_cold)])  # fmt: skip
            for label in ("cold", "again"):
                command = median([c for c, _ in steps[label]])
                snap = median([x for _, x in steps[label]])
                total = median(cold if label == "cold" else again)
                parts.append([size, label, snap, command, total - command, total])
        headers = ["workers", "--type, 1 file changed → running", "by name (rsync)", "ratio",
                   "≤ 1.5 s", "--type, first (cold) → running", "by name (rsync), first",
                   "ratio"]  # fmt: skip
        split = ["workers", "run", "client: snapshot step", "client: whole command",
                 "after the command → running", "total"]  # fmt: skip
        where = "where --type's time went (medians, s)"
        portal = "the portal's time per request (gunicorn, whole run)"
        return (f"{table(headers, rows)}\n\n{where}\n\n{table(split, parts)}\n\n"
                f"{portal}\n\n{self.requests()}")  # fmt: skip

    @staticmethod
    def print_profile(path: str) -> None:
        """The client's own functions that took the most of a run (cumulative)."""
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(path, stream=text).sort_stats("cumulative").print_stats(30)
        print(text.getvalue(), flush=True)

    def requests(self) -> str:
        """Per kind of request the portal answered: how many, the seconds it spent on
        them in all and the median (from gunicorn's access log)."""
        spent: dict[str, list[float]] = {}
        for line in (self.dir / "gunicorn.log").read_text().splitlines():
            found = re.fullmatch(r"(\w+) (/api/v1/\S+) (\d+) ([\d.]+)", line.strip())
            if not found:
                continue
            path = re.sub(r"/\d+", "/N", re.sub(r"[0-9a-f]{64}", "SHA", found[2]))
            spent.setdefault(f"{found[1]} {path} {found[3]}", []).append(float(found[4]))
        rows = [[k, len(v), sum(v), median(v)] for k, v in sorted(spent.items())]
        return table(["request", "count", "seconds in all", "median"], rows)

    # --- 2. tpu exec -----------------------------------------------------------------------

    def close_shared(self) -> None:
        """Close the client's shared ssh connections, with the client's own code."""
        code = (
            "from tpu_cli import connections, sshfiles; "
            "connections.close_shared(sshfiles.ssh_base())"
        )
        self.tpu_ok(*TPU[:3], "-c", code)

    def part_exec(self) -> list[str]:
        rows = []
        for size in self.args.sizes:
            cold, warm, serial = [], [], []
            loop = "; ".join(f"ssh -o BatchMode=yes jobs{size}-w{i} true || exit 1"
                             for i in range(size))  # fmt: skip
            argv = [*TPU, "exec", f"jobs{size}", "--worker", "all", "--", "true"]
            for _ in range(self.args.reps):
                self.close_shared()
                for runs in (cold, warm):
                    began = time.perf_counter()
                    self.tpu_ok(*argv)
                    runs.append(time.perf_counter() - began)
                began = time.perf_counter()
                self.tpu_ok("sh", "-c", loop)
                serial.append(time.perf_counter() - began)
                print(
                    f"  {size} workers: tpu exec {cold[-1]:.2f} s (no shared connection yet), "
                    f"{warm[-1]:.2f} s (again), serial {serial[-1]:.2f} s",
                    flush=True,
                )
            rows.append(
                [
                    size,
                    median(cold),
                    median(warm),
                    median(serial),
                    median(cold) / median(serial),
                    median(warm) / median(serial),
                ]
            )
        headers = ["workers", "tpu exec, first (opens the connections)", "tpu exec, again",
                   "serial ssh loop", "ratio first", "ratio again"]  # fmt: skip
        return table(headers, rows)

    def close(self) -> None:
        try:
            self.close_shared()
        except Exception as exc:  # the scene may be half made; the rest must still go
            print(f"closing the shared ssh connections: {exc}", file=sys.stderr)
        super().close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,32", help="workers per pod (default 4,32)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per size (1..10)")
    parser.add_argument(
        "--parts", default="run,exec", help="which parts: run, exec, pool (default run,exec)"
    )
    parser.add_argument(
        "--long-runtime",
        action="store_true",
        help="the laptop's XDG_RUNTIME_DIR as long as /run/user/<10-digit uid>",
    )
    parser.add_argument(
        "--profile", action="store_true", help="pool: the client's re-run under cProfile"
    )
    args = parser.parse_args(argv)
    args.parts = set(args.parts.split(","))
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.reps = max(1, min(args.reps, 10))
    args.poll, args.grace = 1, 2
    if os.geteuid() != 0:
        print("the fleet needs root (network namespaces)", file=sys.stderr)
        return 2
    bench = CliBench(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        bench.start()
        runs = execs = pools = ""
        if "pool" in args.parts:
            print("3. tpu run --type --workdir (a snapshot) beside tpu run VM (rsync) …",
                  flush=True)  # fmt: skip
            pools = bench.part_pool()
        if "run" in args.parts:
            print("1. tpu run, first sync and one file changed → running …", flush=True)
            runs = bench.part_run()
        if "exec" in args.parts:
            print("2. tpu exec on every worker …", flush=True)
            execs = bench.part_exec()
        print()
        print(f"machine: {machine()}")
        runtime = f"; XDG_RUNTIME_DIR {bench.laptop.runtime}" if args.long_runtime else ""
        print(f"{FILES} files, {SIZE // 2**20} MB; sizes {args.sizes}; {args.reps} "
              f"repetitions{runtime}")  # fmt: skip
        print(f"\n{runs}\n\n{execs}\n\n{pools}")
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

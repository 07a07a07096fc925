"""A job submitted to a kind of VM with a free VM (the lab's pool, ``tpu run --type``)
until it runs, beside the same job submitted to that VM by name, through the portal's
API:

    sudo-capable root shell, from the repository root (PostgreSQL and Redis running):
    .venv/bin/python -m bench.poolsubmit [--sizes 1,4] [--reps 7]

The scene of ``bench.jobstart`` (fleet, emulator, a live portal under gunicorn, a real
``celery worker``): one VM per size, each the only one of its accelerator type
(``v4-8`` for 1 worker, ``v4-32`` for 4), free, the collaborator granted on it.

- **by name**: ``POST /api/v1/labs/{slug}/vms/{vm}/jobs``;
- **by kind**: ``POST /api/v1/labs/{slug}/jobs`` with the VM's ``accelerator_type``:
  placement picks the one free VM of the kind inside the submit and queues its pass
  with the commit, as a submit by name does.

Both ``sleep 600`` with the person's JAX environment, both timed from the POST's
answer to the first ``GET /api/v1/me/jobs/{id}`` (every 50 ms) that says ``running``
(on that VM); the job is cancelled and has ended before the next sample (untimed). One
untimed warm-up of each way per size, then the repetitions, alternating which goes
first. Target: by kind ≤ by name + 0.2 s (medians).
"""

from __future__ import annotations

import argparse
import sys

from bench.common import machine, median, run_on_fleet, table
from bench.jobstart import StartBench

TARGET_SECONDS = 0.2


class PoolSubmitBench(StartBench):
    def run(self) -> None:
        rows, submits, phases = [], [], []
        self.phases = []
        for size in self.args.sizes:
            for kind in (False, True, False, True):  # warm-up: each worker process, each way
                self.portal(size, kind=kind)
            taken = {False: [], True: []}
            posts = {False: [], True: []}
            parts = {False: [], True: []}
            for rep in range(1, self.args.reps + 1):
                # Alternate which goes first: neither always follows the other's cancel.
                for kind in (False, True) if rep % 2 else (True, False):
                    self.phases = []
                    took, post = self.portal(size, kind=kind)
                    taken[kind].append(took)
                    posts[kind].append(post)
                    parts[kind].append(self.phases[0])
                print(f"  {size:>2} worker(s), rep {rep}: by name {taken[False][-1]:.3f} s, "
                      f"by kind {taken[True][-1]:.3f} s", flush=True)  # fmt: skip
            name, kind = median(taken[False]), median(taken[True])
            verdict = "met" if kind <= name + TARGET_SECONDS else "MISSED"
            vm = self.vms[size]
            # The same with each POST's own time added (the kind's placement is in it).
            whole = {way: median(t + p for t, p in zip(taken[way], posts[way], strict=True))
                     for way in (False, True)}  # fmt: skip
            rows.append([f"{size} ({vm.accelerator_type})", name, kind, kind - name,
                         whole[True] - whole[False], verdict])  # fmt: skip
            submits.append([size, median(posts[False]), median(posts[True]),
                            median(posts[True]) - median(posts[False])])  # fmt: skip
            for way in (False, True):
                names = list(parts[way][0])
                phases.append([size, "by kind" if way else "by name",
                               *(median(p[n] for p in parts[way]) for n in names)])  # fmt: skip
        print()
        print(f"machine: {machine()}")
        print(f"sizes {self.args.sizes}, {self.args.reps} repetitions of each way after an "
              "untimed warm-up")  # fmt: skip
        print()
        print(
            "submit's answer → the API says running (medians, seconds; polled every 50 ms; "
            "`sleep 600` with a pre-flight of the person's JAX environment)"
        )
        print(table(["workers", "by name", "by kind", "kind − name",
                     "kind − name, POST included", "target ≤ +0.2 s"], rows))  # fmt: skip
        print()
        print(table(["workers", "submit POST by name", "by kind", "kind − name"], submits))
        print()
        print("where the time went (medians, seconds, from the worker's probes): as in "
              "bench.jobstart")  # fmt: skip
        print(table(["workers", "way", "pickup", "→ pre-flight", "pre-flight", "between",
                     "start", "commit", "seen"], phases))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="workers per VM (default 1,4)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each way (1..20)")
    args = parser.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.reps = max(1, min(args.reps, 20))
    args.poll, args.grace = 5, 1  # the shared scene's settings; no beat runs here
    return run_on_fleet(PoolSubmitBench(args))


if __name__ == "__main__":
    sys.exit(main())

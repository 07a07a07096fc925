"""The periodic polls: one sync over 500 VMs in 5 zones, IP change → email sent, and
what reading chip metrics adds to a 32-worker job poll.

    /work/main/.venv/bin/python -m bench.poll            # 60 s beat interval (~6 min)
    /work/main/.venv/bin/python -m bench.poll --quick    # 5 s interval (~1 min)
    /work/main/.venv/bin/python -m bench.poll --chips    # part 3 alone (~2 min)

Part 1 calls ``tpus.services.sync.sync_inventory`` in this process against the Cloud
TPU emulator (500 VMs, one lab, 5 zones; every tenth VM a 4-worker pod) and counts
the API calls on both sides (the portal's client and the emulator's server), the
database queries, and the wall time of a few polls; once more with a page size of
50 to show the paging.

Part 2 starts a real ``celery beat`` and ``celery worker`` (subprocesses, Redis broker,
``PORTAL_SYNC_SECONDS`` = the interval) and an SMTP sink (aiosmtpd on 127.0.0.1);
changes a worker's external IP in the emulator at a random moment and measures until
the email with the new address arrives at the sink. No SSH leaves this machine: the
remote door runs dry and only loopback is allowed.

Part 3 (``--chips``, on its own) starts 32 fleet hosts and times the job poll's status
round on all of them through the remote door (``job-status.sh``, one exec per worker,
the input the job engine sends for a running job and the VM's chips), side by side in
one run, rounds interleaved: today's input; the same asking for chip metrics with a
stand-in of libtpu's metrics server on every host (4 chips each); and asking where
nothing serves metrics. Each round connects anew, as a pass does; the exec alone over
kept connections is timed too. Then the portal's side: parsing the 32 answers and
``chip_metrics.record`` (queries and time).
"""

from __future__ import annotations

import argparse
import dataclasses
import email
import email.policy
import os
import random
import secrets
import shutil
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from django.utils import timezone

from bench.common import Stack, machine, median, table

PROJECT = "bench-lab"
SYNC_TASK = "tpus.tasks.sync_inventory"
MAIL_TASK = "tpus.tasks.send_ip_change_email"
ZONES = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "europe-west4-a"]


class Sink:
    """An SMTP server on 127.0.0.1 that notes when each message arrived."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.messages: list[tuple[float, str, str]] = []  # (arrived, to, subject)
        self._arrived = threading.Condition()
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                arrived = time.time()
                message = email.message_from_bytes(
                    envelope.original_content or envelope.content, policy=email.policy.default
                )
                with sink._arrived:
                    sink.messages.append((arrived, str(message["To"]), str(message["Subject"])))
                    sink._arrived.notify_all()
                return "250 OK"

        with __import__("socket").socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()
        self.url = f"smtp://127.0.0.1:{self.port}"

    def wait_for(self, text: str, timeout: float) -> float | None:
        """When the first message whose subject contains ``text`` arrived."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for arrived, _, subject in self.messages:
                    if text in subject:
                        return arrived
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arrived.wait(left)

    def count(self, text: str) -> int:
        with self._arrived:
            return sum(1 for _, _, subject in self.messages if text in subject)

    def stop(self) -> None:
        self.controller.stop()


@contextmanager
def counting_queries():
    from django.db import connection

    counter = Counter()

    def count(execute, sql, params, many, context):
        counter["queries"] += 1
        return execute(sql, params, many, context)

    with connection.execute_wrapper(count):
        yield counter


class PollBench:
    def __init__(self, args):
        self.args = args
        self.interval = 5 if args.quick else 60
        self.stack = Stack("poll")
        self.emulator = None
        self.sink = None

    def start(self) -> None:
        from tpus.emulator.testing import start_emulator

        self.emulator = start_emulator(self.stack.dir / "tpu-emulator.json")
        self.sink = Sink()
        self.stack.setup_django(
            BENCH_TPU_API_ENDPOINT=self.emulator.endpoint,
            BENCH_REMOTE_ALLOWED_NETWORKS="127.0.0.0/8",
            PORTAL_REMOTE_DRY_RUN="true",
            PORTAL_SYNC_SECONDS=self.interval,
            PORTAL_TEST_EMAIL_URL=self.sink.url,
            PORTAL_ADMIN_SSH_USER="admin",
        )
        import logging

        logging.getLogger("tpus").setLevel(logging.WARNING)
        logging.getLogger("mail.log").setLevel(logging.WARNING)  # the SMTP sink's chatter
        print(f"registering {self.args.vms} VMs in {len(ZONES)} zones …", flush=True)
        self._scene()

    def _scene(self) -> None:
        from django.db.models import F

        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Grant, Lab, Membership, TpuVm
        from tpus.services import inventory

        per_zone = self.args.vms // len(ZONES)
        controls = self.emulator.controls
        names: dict[str, list[str]] = {}
        with controls.batch():
            for z, zone in enumerate(ZONES):
                names[zone] = []
                for i in range(per_zone):
                    name = f"tpu-{z}-{i:03d}"
                    pod = i % 10 == 0
                    controls.add_node(
                        PROJECT, zone, name, accelerator_type="v4-32" if pod else "v4-8",
                        workers=4 if pod else 1,
                    )  # fmt: skip
                    names[zone].append(name)
        self.lab = Lab.objects.create(
            name="Bench Lab", slug="bench", gcp_project_id=PROJECT, zones=ZONES
        )
        admin = User.objects.create_user(email="boss@bench.example", password="x" * 12)
        for zone in ZONES:
            inventory.import_vms(admin, self.lab, [f"{zone}/{n}" for n in names[zone]])
        # The person who hears about the change: active on the VM whose IP will move.
        self.target = names[ZONES[2]][7]
        vm = TpuVm.objects.get(lab=self.lab, name=self.target)
        milo = User.objects.create_user(email="milo@uni.example", password="x" * 12)
        Membership.objects.create(
            lab=self.lab, user=milo, role="member", state="approved",
            policy_version_accepted=self.lab.policy_version, policy_accepted_at=timezone.now(),
        )  # fmt: skip
        choose_username(milo, f"milo{secrets.token_hex(2)}")
        # Active by hand, as a finished reconcile would leave it; no reconcile is queued.
        TpuVm.objects.filter(pk=vm.pk).update(desired_version=F("desired_version") + 1)
        vm.refresh_from_db()
        Grant.objects.create(user=milo, vm=vm, state="active", version=vm.desired_version)

    # --- part 1: one poll ---------------------------------------------------------------

    def polls(self) -> tuple[list[list], list[list]]:
        from tpus.cloud import config as cloud_config
        from tpus.services.sync import sync_inventory

        rows = []
        for i in range(1, self.args.polls + 1):
            rows.append(self._one_poll(f"{i}", sync_inventory, cloud_config.cloud_tpu()))
        # The same with a page size of 50 (100 VMs per zone → 2 pages each).
        original = cloud_config.config_from_settings
        cloud_config.config_from_settings = lambda: dataclasses.replace(original(), page_size=50)
        try:
            paged = self._one_poll("page size 50", sync_inventory, cloud_config.cloud_tpu())
        finally:
            cloud_config.config_from_settings = original
        return rows, [paged]

    def _one_poll(self, label, sync_inventory, client) -> list:
        client.reset_calls()
        served = Counter(self.emulator.requests)
        with counting_queries() as queries:
            t0 = time.perf_counter()
            report = sync_inventory()
            elapsed = time.perf_counter() - t0
        server = Counter(self.emulator.requests)
        server.subtract(served)
        return [
            label, report.listed, client.calls.get("ListNodes", 0), server.get("ListNodes", 0),
            sum(client.calls.values()), queries["queries"], elapsed, len(report.errors),
        ]  # fmt: skip

    # --- part 2: IP change → email ------------------------------------------------------

    def latency(self) -> list[list]:
        print(f"starting celery worker and beat (sync every {self.interval} s) …", flush=True)
        self.stack.start_worker()
        self.stack.start_beat()
        # Start measuring once beat's rhythm is set: the first poll has run.
        if self._next_sync_end(time.time() - 1, self.interval + 120) is None:
            raise RuntimeError("no poll ran:\n" + self.stack.log("beat")[-2000:])
        rows = []
        for k in range(1, self.args.samples + 1):
            time.sleep(random.uniform(0, self.interval))
            new_ip = f"198.19.{k}.{random.randint(2, 250)}"
            t0 = time.time()
            self.emulator.controls.set_ip(self.target, 0, new_ip)
            arrived = self.sink.wait_for(new_ip, timeout=2 * self.interval + 60)
            if arrived is None:
                raise RuntimeError(f"no email about {new_ip}:\n" + self.stack.log("worker")[-3000:])
            events = self.stack.events.all()
            time.sleep(1.0)  # a second email would have arrived by now
            poll = max(
                (e["t"] for e in events
                 if e["kind"] == "task_start" and e.get("task") == SYNC_TASK and e["t"] <= arrived),
                default=float("nan"),
            )  # fmt: skip
            mail_task = min(
                (e["t"] for e in events
                 if e["kind"] == "task_start" and e.get("task") == MAIL_TASK and e["t"] >= t0),
                default=float("nan"),
            )  # fmt: skip
            rows.append([
                k, arrived - t0, poll - t0, mail_task - poll, arrived - mail_task,
                self.sink.count(new_ip),
            ])  # fmt: skip
            print(f"  sample {k}: {arrived - t0:.2f} s", flush=True)
        return rows

    def _next_sync_end(self, after: float, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.stack.events.all():
                if e["kind"] == "task_end" and e.get("task") == SYNC_TASK and e["t"] > after:
                    return e["t"]
            time.sleep(0.2)
        return None

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        polls, paged = self.polls()
        latency = [] if self.args.skip_latency else self.latency()
        print()
        print(f"machine: {machine()}")
        print(
            f"one poll (sync_inventory, in-process): {self.args.vms} VMs in {len(ZONES)} zones "
            f"of one project, API page size 500 (the client's default)"
        )
        headers = ["poll", "nodes listed", "ListNodes (client)", "ListNodes (server)",
                   "API calls", "DB queries", "seconds", "zone errors"]  # fmt: skip
        print(table(headers, polls + paged))
        walls = [row[6] for row in polls]
        print(f"median poll: {median(walls):.3f} s; API calls per poll: {polls[-1][4]} "
              f"(target: {len(ZONES)} + paging)")  # fmt: skip
        if latency:
            print()
            print(
                f"IP change → email at the sink (celery beat every {self.interval} s, "
                "worker and beat as subprocesses, Redis broker, SMTP on 127.0.0.1)"
            )
            headers = ["sample", "latency", "change → poll start", "poll start → mail task",
                       "mail task → at sink", "emails"]  # fmt: skip
            print(table(headers, latency))
            print(
                "(seconds; a negative 'change → poll start' is a poll that was already running "
                "and listed the zone after the change)"
            )
            values = [row[1] for row in latency]
            target = self.interval + 5
            print(
                f"median {median(values):.2f} s, max {max(values):.2f} s; "
                f"max/interval {max(values) / self.interval:.2f}; "
                f"target ≤ interval + 5 s = {target} s: "
                f"{'met' if max(values) <= target else 'MISSED'}"
            )

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            if self.sink is not None:
                self.sink.stop()
            if self.emulator is not None:
                self.emulator.stop()
            shutil.rmtree(self.stack.dir, ignore_errors=True)


class ChipPollBench:
    """Part 3: the job poll's status round on 32 workers with and without chip metrics."""

    def __init__(self, args):
        self.args = args
        self.stack = Stack("chippoll")
        self.fleet = None
        self.servers = []

    def start(self) -> None:
        from testfleet.fleet import Fleet

        print(f"starting a fleet of {self.args.workers} sshd hosts …", flush=True)
        self.fleet = Fleet.open_free()
        self.fleet.teardown()  # leftovers of a crashed run in this slot
        self.fleet.up(self.args.workers)
        self.hosts = [self.fleet.host(f"h{i}") for i in range(1, self.args.workers + 1)]
        self.stack.setup_django(
            BENCH_TPU_API_ENDPOINT="127.0.0.1:1",
            BENCH_REMOTE_ALLOWED_NETWORKS=f"127.0.0.0/8,{self.fleet.network}",
            PORTAL_ADMIN_SSH_KEY_FILE=self.fleet.admin_key_path,
            PORTAL_ADMIN_SSH_USER=self.fleet.admin_user,
            PORTAL_REMOTE_CONNECT_TIMEOUT=5,
            PORTAL_REMOTE_AUTH_TIMEOUT=10,
            PORTAL_REMOTE_SCRIPT_TIMEOUT=60,
        )
        import logging

        logging.getLogger("tpus").setLevel(logging.WARNING)
        from tpus.remote import HostKeyPins, Worker, site_login

        self.workers = [
            Worker(h.ip, HostKeyPins.parse(self.fleet.host_keys(h.name)), name=h.name,
                   login=site_login())
            for h in self.hosts
        ]  # fmt: skip

    def _serve_metrics(self) -> None:
        from testfleet import runtime_metrics

        values = self.stack.dir / "chips.json"
        gib = 1024**3
        chips = [{"chip": n, "hbm_used": (8 + n) * gib, "hbm_total": 32 * gib, "duty": 80.0 + n}
                 for n in range(4)]  # fmt: skip
        runtime_metrics.write_values(values, chips)
        print(f"starting the metrics stand-in on {len(self.hosts)} hosts …", flush=True)
        self.servers = [runtime_metrics.start(self.fleet, h.name, values) for h in self.hosts]
        for process in self.servers:
            runtime_metrics.wait_serving(process)

    def _stop_metrics(self) -> None:
        from testfleet import runtime_metrics

        for process in self.servers:
            runtime_metrics.stop(process)
        self.servers = []

    def _inputs(self) -> dict[str, bytes]:
        from tpus.remote import jobs as wire
        from tpus.services import chip_metrics

        def status(ports=()):
            return wire.encode_status(
                {"bench-job": 0}, max_bytes=32768, device_glob="/dev/accel*", tail=True,
                metrics_ports=ports,
            )  # fmt: skip

        return {"today": status(), "metrics": status(chip_metrics.ports())}

    def _round(self, data: bytes, sessions=None) -> tuple[float, list]:
        from tpus.remote import run_on_workers

        t0 = time.perf_counter()
        if sessions is None:
            outcomes = run_on_workers(self.workers, "job-status.sh", data)
        else:
            outcomes = sessions.run("job-status.sh", data)
        elapsed = time.perf_counter() - t0
        bad = [str(o.error) for o in outcomes if not o.ok]
        if bad:
            raise RuntimeError(f"job-status.sh failed: {bad[:3]}")
        return elapsed, outcomes

    def _server_cpu(self) -> float:
        """CPU seconds the stand-in servers have used so far (they share the fleet's
        cores; libtpu's server runs on each TPU VM's own)."""
        total = 0.0
        for process in self.servers:
            with open(f"/proc/{process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def _side_by_side(self, label: str, rounds: int) -> tuple[list, list, float]:
        """Rounds of today's input and the metrics input, alternating (and which goes
        first alternating), each connecting anew; then the same over kept connections;
        then on one worker alone over a kept connection (what each worker adds, in
        parallel, when each is its own machine)."""
        from tpus.remote import Sessions

        inputs = self._inputs()
        fresh = {"today": [], "metrics": []}
        kept = {"today": [], "metrics": []}
        alone = {"today": [], "metrics": []}
        outcomes = None
        self._round(inputs["metrics"])  # warm-up
        cpu0 = self._server_cpu() if self.servers else 0.0
        for r in range(rounds):
            order = ["today", "metrics"] if r % 2 == 0 else ["metrics", "today"]
            for name in order:
                elapsed, found = self._round(inputs[name])
                fresh[name].append(elapsed)
                if name == "metrics":
                    outcomes = found
        server_cpu = (self._server_cpu() - cpu0) / rounds if self.servers else 0.0
        for times, workers in ((kept, self.workers), (alone, self.workers[:1])):
            with Sessions(workers) as sessions:
                self._round(inputs["today"], sessions)  # every connection made
                for r in range(rounds):
                    order = ["today", "metrics"] if r % 2 == 0 else ["metrics", "today"]
                    for name in order:
                        times[name].append(self._round(inputs[name], sessions)[0])
        rows = []
        for what, times in (("poll (connect + exec)", fresh), ("exec alone", kept),
                            ("exec on 1 worker", alone)):  # fmt: skip
            today, metrics = median(times["today"]), median(times["metrics"])
            rows.append([label, what, today, metrics, metrics - today, metrics / today - 1])
        return rows, outcomes, server_cpu

    def _portal_side(self, outcomes) -> list:
        from tpus.models import Lab, TpuVm
        from tpus.services import chip_metrics

        lab = Lab.objects.create(name="Chips", slug="chips", gcp_project_id="chips-bench")
        vm = TpuVm.objects.create(lab=lab, name="pod32", zone="us-central1-a", source="manual")
        workers = [type("W", (), {"index": i})() for i in range(len(outcomes))]
        rows = []
        for n in range(3):
            with counting_queries() as queries:
                t0 = time.perf_counter()
                answers = chip_metrics.answers(workers, outcomes)
                t1 = time.perf_counter()
                chip_metrics.record(vm, answers)
                t2 = time.perf_counter()
            chips = sum(len(a.chips) for a in answers.values() if a)
            rows.append([n + 1, chips, (t1 - t0) * 1000, (t2 - t1) * 1000, queries["queries"]])
        return rows

    def run(self) -> None:
        rounds = self.args.rounds
        self._serve_metrics()
        served, outcomes, server_cpu = self._side_by_side("4 chips served per worker", rounds)
        self._stop_metrics()
        unserved, _, _ = self._side_by_side("nothing serves metrics", rounds)
        portal = self._portal_side(outcomes)
        print()
        print(f"machine: {machine()}")
        print(
            f"job poll status round on {len(self.workers)} workers (job-status.sh through the "
            f"remote door, one exec per worker), median of {rounds} interleaved rounds each"
        )
        headers = ["metrics", "round", "today (s)", "with metrics (s)", "added (s)", "added"]
        print(table(headers, [r[:5] + [f"{r[5]:+.1%}"] for r in served + unserved]))
        print()
        print("the portal's side per poll of the VM: parse the answers, record (at most 4 queries)")
        headers = ["run", "chips", "parse (ms)", "record (ms)", "DB queries"]
        print(table(headers, portal))
        from django.conf import settings

        poll, every = settings.PORTAL_JOB_POLL_SECONDS, settings.PORTAL_CHIP_METRICS_EVERY_SECONDS
        share = 1 / max(1, round(every / poll))
        today, added = served[0][2], served[0][4]
        on_own = served[2][4]  # one worker's added time: each worker is its own machine
        print(
            f"the {len(self.servers) or len(self.workers)} stand-in servers used "
            f"{server_cpu:.3f} CPU s per round of the fleet's 2 cores (on TPU VMs, libtpu "
            "answers on each VM's own cores)"
        )
        print(
            f"added to the {len(self.workers)}-worker poll that reads metrics: {added / today:+.1%}"
            f" here, where all workers share 2 cores; {on_own / today:+.1%} when each worker "
            f"adds what one alone adds ({on_own * 1000:.0f} ms); the job poll runs every "
            f"{poll} s and reads metrics every {every} s, so on average "
            f"{share * added / today:+.1%} here and {share * on_own / today:+.1%} on own machines"
            " (target ≤ +10 %); no SSH session added (one job-status.sh exec per worker)"
        )

    def close(self) -> None:
        try:
            self._stop_metrics()
        finally:
            try:
                self.stack.close()
            finally:
                if self.fleet is not None:
                    self.fleet.destroy()
                shutil.rmtree(self.stack.dir, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s beat interval instead of 60 s")
    parser.add_argument("--vms", type=int, default=500)
    parser.add_argument("--polls", type=int, default=5, help="timed polls in part 1 (1..10)")
    parser.add_argument(
        "--samples", type=int, default=None, help="IP changes (default 5 quick, 3 full)"
    )
    parser.add_argument("--skip-latency", action="store_true", help="part 1 only")
    parser.add_argument("--chips", action="store_true", help="part 3 alone: chip metrics")
    parser.add_argument("--workers", type=int, default=32, help="part 3: workers (1..64)")
    parser.add_argument("--rounds", type=int, default=10, help="part 3: rounds (3..30)")
    args = parser.parse_args(argv)
    if args.chips:
        args.workers = max(1, min(args.workers, 64))
        args.rounds = max(3, min(args.rounds, 30))
        chips = ChipPollBench(args)
        try:
            chips.start()
            chips.run()
        finally:
            chips.close()
        return 0
    args.polls = max(1, min(args.polls, 10))
    args.samples = max(1, min(args.samples or (5 if args.quick else 3), 6))
    args.vms = max(len(ZONES), min(args.vms, 2000))
    bench = PollBench(args)
    try:
        bench.start()
        bench.run()
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

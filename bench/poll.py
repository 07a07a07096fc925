"""The periodic poll: one sync over 500 VMs in 5 zones, and IP change → email sent.

    /work/main/.venv/bin/python -m bench.poll            # 60 s beat interval (~6 min)
    /work/main/.venv/bin/python -m bench.poll --quick    # 5 s interval (~1 min)

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 s beat interval instead of 60 s")
    parser.add_argument("--vms", type=int, default=500)
    parser.add_argument("--polls", type=int, default=5, help="timed polls in part 1 (1..10)")
    parser.add_argument(
        "--samples", type=int, default=None, help="IP changes (default 5 quick, 3 full)"
    )
    parser.add_argument("--skip-latency", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
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

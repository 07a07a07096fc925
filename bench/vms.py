"""TPU VMs the portal makes, on the fleet: capacity released → every granted person
logs in on every worker; preempted → back with everything; and beside them the seeds'
manual way (``until gcloud … create; do :; done``, then import, connect, grant again)
against the same emulator, timed the same way, in one run.

    sudo-capable root shell, from the repository root:
    .venv/bin/python -m bench.vms [--types v4-32] [--reps 5] [--sync 10] [--follow 2]

What runs: a fleet of real sshd hosts (testfleet) offered to the Cloud TPU emulator as
the machines new nodes are made of (twice as many as one VM needs: a VM comes back on
other machines while Google makes the old ones new), Google's side of those hosts in
two threads of this process (the guest agent applying each node's ``ssh-keys``, and
released machines made new), PostgreSQL and Redis (a database of this run's own), a
real ``celery worker`` and ``celery beat`` (sync every ``--sync`` s, the pass that
follows VM requests every ``--follow`` s). The lab has a spot VM the portal made,
kept alive, with ``--people`` collaborators granted on it.

a. capacity released: the VM is preempted while its zone is stocked out; once it is
   asked for again and waiting, the stockout is lifted at a random moment within one
   follow interval. Timed until every person's plain ``ssh`` works on every worker.
b. preempted, capacity there: at a random moment within one sync interval the VM is
   preempted; timed until every person logs in on every worker again.
c. the manual way: the real google-cloud-tpu client creates the node in a loop until
   the stockout ends, then the admin's clicks as the services behind them: import,
   connect (until the page says connected), grant each person. Timed from the same
   release until every person logs in on every worker.

Each step's moment comes from PostgreSQL (a trigger sends a NOTIFY with its clock at
each commit that changes a VM's or a request's state), the emulator (when it made the
node) and the worker's probes (each reconcile's start and end, ``bench.celeryapp``).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from bench.common import Stack, machine, median, run_on_fleet, table
from bench.provision import SSH_OPTIONS, new_keypair

PROJECT, ZONE = "bench-vms", "us-central2-b"
RUNTIME = "tpu-ubuntu2204-base"
CHANNEL = "bench_vm_changes"
LOGIN_TIMEOUT = 240.0
RECONCILE = "tpus.tasks.reconcile_vm"
HEADERS = {
    "a": ["type", "rep", "release → login", "reconcile", "login − reconcile", "target",
          "≤ target", "release → portal looks", "→ VM in lab", "→ reconcile start",
          "→ reconcile end", "→ login", "reconciles"],
    "b": ["type", "rep", "preempt → login", "target", "≤ target", "→ noticed by sync",
          "→ request sent", "→ node ready", "→ VM in lab", "→ reconcile end", "→ login",
          "reconciles"],
    "c": ["type", "rep", "release → login", "portal (a) same rep", "manual / portal",
          "release → created", "→ imported", "→ connected", "→ granted", "→ login",
          "create tries"],
}  # fmt: skip


class Changes:
    """When a VM's or a request's state changed, as committed: deferred constraint
    triggers send a NOTIFY with the table, the row, its new state and PostgreSQL's clock
    at that commit (the clock every part of this run shares)."""

    def __init__(self) -> None:
        import psycopg
        from django.db import connection

        from tpus.models import TpuVm, VmRequest

        self.tables = {TpuVm: TpuVm._meta.db_table, VmRequest: VmRequest._meta.db_table}
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION bench_vm_change() RETURNS trigger AS $$ BEGIN "
                f"PERFORM pg_notify('{CHANNEL}', TG_TABLE_NAME || ' ' || NEW.id || ' ' "
                "|| NEW.state || ' ' || extract(epoch FROM clock_timestamp())); "
                "RETURN NULL; END $$ LANGUAGE plpgsql"
            )
            for table_name in self.tables.values():
                cursor.execute(
                    f"CREATE CONSTRAINT TRIGGER bench_change AFTER UPDATE ON {table_name} "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                    "WHEN (NEW.state IS DISTINCT FROM OLD.state) "
                    "EXECUTE FUNCTION bench_vm_change()"
                )
        db = connection.settings_dict
        self.conn = psycopg.connect(
            dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"] or None,
            host=db["HOST"] or None, port=db["PORT"] or None, autocommit=True,
        )  # fmt: skip
        self.conn.execute(f"LISTEN {CHANNEL}")
        self.seen: list[tuple[str, int, str, float]] = []

    def _read(self, timeout: float) -> None:
        """What has arrived; with a ``timeout``, also wait that long for one more."""
        notes = list(self.conn.notifies(timeout=0))
        if not notes and timeout > 0:
            notes = list(self.conn.notifies(timeout=timeout, stop_after=1))
        for note in notes:
            table_name, pk, state, at = note.payload.split()
            self.seen.append((table_name, int(pk), state, float(at)))

    def find(self, model, state: str, after: float, pk: int | None = None) -> tuple | None:
        """(row id, commit time) of the first change of a row of ``model`` into
        ``state`` committed after ``after``."""
        self._read(0)
        for table_name, row, new_state, at in self.seen:
            if table_name == self.tables[model] and new_state == state and at >= after:
                if pk is None or row == pk:
                    return row, at
        return None

    def wait(self, model, state: str, after: float, deadline: float, pk: int | None = None):
        while (found := self.find(model, state, after, pk)) is None:
            if time.time() > deadline:
                raise RuntimeError(f"no {model.__name__} became {state} in time")
            self._read(min(1.0, deadline - time.time()))
        return found


class Agent:
    """Google's side of the fleet, in two threads: the guest agent applying each node's
    ``ssh-keys`` metadata to its hosts as soon as the emulator's state shows it (a look
    every 20 ms, a stat of the state file while nothing changed: Google's agent waits on
    the metadata server for a change and applies it at once), and the machines a
    preempted or deleted node gave back made new (``renew_released``, every 0.2 s;
    ``prepare(host)`` on each before it is offered again). Apart, a renewal (seconds
    per host) never holds up the keys of a VM made of other machines meanwhile."""

    KEYS_EVERY, RENEW_EVERY = 0.02, 0.2

    def __init__(self, fleet, state_file: Path, prepare=None):
        from tpus.emulator.store import Store

        self.fleet, self.store, self.prepare = fleet, Store(state_file), prepare
        self.applied: dict = {}
        self._done: tuple = (None, 0.0)  # the state last applied in full, and when
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(self._keys, self.KEYS_EVERY), daemon=True),
            threading.Thread(target=self._loop, args=(self._renew,), daemon=True),
        ]

    def _keys(self) -> None:
        from testfleet.guestagent import apply_once

        # The same object while the file is unchanged: looked at in full again every
        # RENEW_EVERY all the same (a host that was down meanwhile gets its keys).
        state, now = self.store.read(), time.monotonic()
        if state is self._done[0] and now < self._done[1] + self.RENEW_EVERY:
            return
        started = time.time()
        passed = apply_once(self.fleet, state, skip=self.applied)
        self._done = (None, 0.0) if passed.errors else (state, now)
        if passed.hosts:  # on the timeline of ``bench/elastic.py --timeline``
            from bench.celeryapp import emit

            emit("agent_keys", start=started, end=time.time(), hosts=sorted(passed.hosts))

    def _renew(self) -> None:
        from testfleet.guestagent import renew_released

        for name in renew_released(self.fleet, self.store, self.prepare):
            self.applied.pop(name, None)

    def _loop(self, step, every: float = RENEW_EVERY) -> None:
        while not self.stopping.is_set():
            try:
                step()
            except Exception as exc:  # keep going, as the real agent does
                print(f"(agent: {exc})", file=sys.stderr)
            self.stopping.wait(every)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=60)


class Bench:
    def __init__(self, args):
        self.args = args
        self.tag = secrets.token_hex(2)
        self.rng = random.Random(int(self.tag, 16))
        self.stack = Stack("vms")
        self.dir = self.stack.dir
        self.fleet = self.emulator = self.agent = None

    # --- scene --------------------------------------------------------------------------

    def start(self) -> None:
        from testfleet.fleet import Fleet
        from testfleet.guestagent import offer_hosts
        from tpus.emulator.catalog import default_workers

        self.workers = {t: default_workers(t) for t in self.args.types}
        hosts_needed = 2 * sum(self.workers.values())
        print(f"starting a fleet of {hosts_needed} sshd hosts …", flush=True)
        self.fleet = Fleet.open_free()
        self.fleet.teardown()  # leftovers of a crashed run in this slot
        self.fleet.up(hosts_needed)
        from tpus.emulator.testing import start_emulator

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
            PORTAL_SYNC_SECONDS=self.args.sync,
            PORTAL_VM_REQUEST_POLL_SECONDS=self.args.follow,
            # Nothing else opens SSH sessions on the fleet while a step is timed.
            PORTAL_RECONCILE_SWEEP_SECONDS=3600,
            PORTAL_EXPIRY_CHECK_SECONDS=3600,
            PORTAL_DRIFT_CHECK_SECONDS=3600,
        )
        import logging

        logging.getLogger("tpus").setLevel(logging.WARNING)
        self.changes = Changes()
        self.agent = Agent(self.fleet, self.emulator.state_file)
        self.agent.start()
        print("starting a celery worker and beat …", flush=True)
        self.stack.start_worker()
        self.stack.start_beat()
        self._scene()

    def _scene(self) -> None:
        from django.utils import timezone

        from accounts.keys import add_key
        from accounts.models import User
        from accounts.unix import choose_username
        from tpus.models import Lab, LabAllowance, Membership

        self.lab = Lab.objects.create(
            name="Bench VMs", slug="bench-vms", gcp_project_id=PROJECT, zones=[ZONE]
        )
        LabAllowance.objects.create(lab=self.lab, generation="v4", provisioning="spot", chips=4096)
        approved = {"state": "approved", "policy_version_accepted": self.lab.policy_version,
                    "policy_accepted_at": timezone.now()}  # fmt: skip
        self.admin = User.objects.create_user(email="boss@vms.example", password="x" * 12)
        Membership.objects.create(lab=self.lab, user=self.admin, role="admin", **approved)
        self.people = []
        for i in range(self.args.people):
            name = f"bv{i}x{self.tag}"
            user = User.objects.create_user(email=f"{name}@vms.example", password="x" * 12)
            Membership.objects.create(lab=self.lab, user=user, role="member", **approved)
            choose_username(user, name)
            key = self.dir / f"id_{name}"
            add_key(user, new_keypair(key, f"{name}@laptop"))
            self.people.append((user, name, key))
        self.vms = {t: self._first_vm(t) for t in self.args.types}

    def _first_vm(self, accelerator_type: str):
        """The lab's kept-alive spot VM, made by the portal, with everyone granted."""
        from tpus.models import VmRequest
        from tpus.services.grants import grant_access
        from tpus.services.vm_requests import VmSpec, request_vm

        name = f"keep{self.workers[accelerator_type]}"
        print(f"the portal makes {name} ({accelerator_type}) and grants access …", flush=True)
        spec = VmSpec(name=name, zone=ZONE, accelerator_type=accelerator_type,
                      runtime_version=RUNTIME, provisioning="spot", queued=True,
                      keep_alive=True)  # fmt: skip
        made = request_vm(self.admin, self.lab, spec)
        deadline = time.time() + LOGIN_TIMEOUT
        while (made := VmRequest.objects.get(pk=made.pk)).state != "ready":
            if time.time() > deadline or made.state in ("failed", "cancelled"):
                raise RuntimeError(f"{name}: {made.get_state_display()} {made.error}")
            time.sleep(0.2)
        vm = made.vm
        t0 = time.time()
        for user, _, _ in self.people:
            grant_access(self.admin, self.lab, user, [vm], sudo=False)
        self.logins(vm, t0)
        return vm

    # --- watching -------------------------------------------------------------------------

    def logins(self, vm, after: float) -> float:
        """When the last of everyone's plain ``ssh`` to every worker of ``vm`` worked,
        with the addresses and host keys the portal has now (what the person's config
        and known_hosts feed say). Tries begin once a reconcile of ``vm`` that started
        after ``after`` ended (nobody has an account on a machine made new before), and
        repeat every 0.2 s for the pairs still refused."""
        from tpus.models import Worker
        from tpus.services.sshconfig import names_for, render_known_hosts

        deadline = time.time() + LOGIN_TIMEOUT
        while not self._reconciles(vm.pk, after, time.time()):
            if time.time() > deadline:
                raise RuntimeError(f"{vm.name}: no reconcile ran")
            time.sleep(0.05)
        known_hosts = self.dir / f"known_hosts_{vm.pk}"
        waiting = {(p, w) for p in range(len(self.people)) for w in range(self._count(vm))}
        last = 0.0
        with ThreadPoolExecutor(max_workers=len(waiting)) as pool:
            while waiting:
                if time.time() > deadline:
                    raise RuntimeError(f"{vm.name}: still refused {sorted(waiting)}")
                vm.refresh_from_db()
                workers = {w.index: w for w in Worker.objects.filter(vm=vm)}
                known_hosts.write_text(render_known_hosts([vm]))
                alias = names_for([vm])[vm.pk].alias
                tries = {
                    pair: pool.submit(self._ssh, self.people[pair[0]], workers[pair[1]],
                                      alias(pair[1]), known_hosts)
                    for pair in waiting
                }  # fmt: skip
                for pair, attempt in tries.items():
                    if attempt.result():
                        waiting.discard(pair)
                        last = max(last, time.time())
                if waiting:
                    time.sleep(0.2)
        return last

    @staticmethod
    def _count(vm) -> int:
        return vm.workers.count()

    @staticmethod
    def _ssh(person, worker, alias: str, known_hosts: Path) -> bool:
        _, username, key = person
        if not worker.external_ip:
            return False
        result = subprocess.run(
            ["ssh", *SSH_OPTIONS, "-i", str(key), "-o", f"UserKnownHostsFile={known_hosts}",
             "-o", f"HostKeyAlias={alias}", f"{username}@{worker.external_ip}", "true"],
            capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        return result.returncode == 0

    def _reconciles(self, vm_id: int, after: float, before: float) -> list[tuple[float, float]]:
        """(start, end) of each reconcile of the VM that started after ``after`` and
        ended by ``before``, from the worker's probes."""
        events = self.stack.events.all()
        starts = {e["id"]: e["t"] for e in events
                  if e["kind"] == "task_start" and e["task"] == RECONCILE
                  and e["args"] == [vm_id] and e["t"] >= after}  # fmt: skip
        return sorted(
            (starts[e["id"]], e["t"])
            for e in events
            if e["kind"] == "task_end" and e["id"] in starts and e["t"] <= before
        )

    def _last_reconcile(self, vm_id: int, after: float, login: float) -> tuple[float, float, int]:
        runs = self._reconciles(vm_id, after, login)
        start, end = max(runs, key=lambda run: run[1])
        return start, end, len(runs)

    def _settled(self, timeout: float = 120.0) -> None:
        """Until the machines given back are made new and the worker is idle."""
        deadline = time.time() + timeout
        while self.emulator.controls.released_hosts() and time.time() < deadline:
            time.sleep(0.2)
        self.stack.events.wait_idle(timeout=30)

    def _provisioned_at(self, node_id: str, after: float) -> float | None:
        for record in self.emulator.controls.queued_resources().values():
            at = record.get("provisioned_at")
            if record.get("node_id") == node_id and at:
                moment = datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
                if moment >= after:
                    return moment
        return None

    # --- a. capacity released -----------------------------------------------------------

    def capacity_released(self, accelerator_type: str) -> dict:
        from tpus.models import VmRequest

        vm = self.vms[accelerator_type]
        controls = self.emulator.controls
        controls.set_capacity(ZONE, accelerator_type, 0)
        began = time.time()
        controls.preempt(vm.name)
        # Untimed: the next sync sees it, the follow pass asks for it again, it waits.
        self.changes.wait(VmRequest, "waiting", began, began + LOGIN_TIMEOUT)
        self._settled()
        time.sleep(self.rng.uniform(0, self.args.follow))
        t0 = time.time()
        controls.set_capacity(ZONE, accelerator_type, None)
        _, in_lab = self.changes.wait(VmRequest, "ready", t0, t0 + LOGIN_TIMEOUT)
        login = self.logins(vm, t0)
        start, end, runs = self._last_reconcile(vm.pk, t0, login)
        total, own = login - t0, end - start
        return {
            "total": total, "reconcile": own, "runs": runs,
            "looks": (self._provisioned_at(vm.name, t0) or float("nan")) - t0,
            "in_lab": in_lab - t0, "start": start - t0, "end": end - t0,
            "target": own + 5.0,
        }  # fmt: skip

    # --- b. preempted, capacity there ---------------------------------------------------

    def preempted(self, accelerator_type: str) -> dict:
        from tpus.models import TpuVm, VmRequest

        vm = self.vms[accelerator_type]
        self._settled()
        time.sleep(self.rng.uniform(0, self.args.sync))
        t0 = time.time()
        self.emulator.controls.preempt(vm.name)
        deadline = t0 + LOGIN_TIMEOUT
        _, noticed = self.changes.wait(TpuVm, "PREEMPTED", t0, deadline, pk=vm.pk)
        request_id, sent = self.changes.wait(VmRequest, "waiting", t0, deadline)
        _, in_lab = self.changes.wait(VmRequest, "ready", t0, deadline, pk=request_id)
        login = self.logins(vm, t0)
        ready = self._provisioned_at(vm.name, t0) or in_lab
        start, end, runs = self._last_reconcile(vm.pk, t0, login)
        return {
            "total": login - t0, "noticed": noticed - t0, "sent": sent - t0, "runs": runs,
            "ready": ready - t0, "in_lab": in_lab - t0, "end": end - t0,
            "target": self.args.sync + max(0.0, ready - sent) + (end - start),
        }  # fmt: skip

    # --- c. the manual way --------------------------------------------------------------

    def manual(self, accelerator_type: str, rep: int) -> dict:
        """The seeds' way: ``until gcloud … create; do :; done`` (the real client, one
        try every ``--loop-pause`` s, about what gcloud takes to start), then the admin's
        clicks: import, connect (until connected), grant each person."""
        from google.api_core import exceptions as api_exceptions

        from tpus.models import VmConnection
        from tpus.services.connect import connect_vm
        from tpus.services.grants import grant_access
        from tpus.services.inventory import import_vms

        name = f"hand{self.workers[accelerator_type]}-{rep}"
        client, tpu_v2 = self._client()
        controls = self.emulator.controls
        controls.set_capacity(ZONE, accelerator_type, 0)
        self._settled()
        tries = 0
        created = threading.Event()
        done_at = [0.0]

        def loop():
            nonlocal tries
            node = tpu_v2.Node(accelerator_type=accelerator_type, runtime_version=RUNTIME,
                               scheduling_config=tpu_v2.SchedulingConfig(spot=True))  # fmt: skip
            while True:
                tries += 1
                try:
                    client.create_node(
                        parent=f"projects/{PROJECT}/locations/{ZONE}", node_id=name, node=node
                    ).result(timeout=120)
                except api_exceptions.ResourceExhausted:
                    time.sleep(self.args.loop_pause)
                    continue
                done_at[0] = time.time()
                created.set()
                return

        looping = threading.Thread(target=loop, daemon=True)
        looping.start()
        time.sleep(self.rng.uniform(0, self.args.follow))
        t0 = time.time()
        controls.set_capacity(ZONE, accelerator_type, None)
        if not created.wait(LOGIN_TIMEOUT):
            raise RuntimeError(f"{name}: the create loop never succeeded")
        looping.join()
        [vm] = import_vms(self.admin, self.lab, [f"{ZONE}/{name}"])
        imported = time.time()
        connect_vm(self.admin, vm)
        deadline = time.time() + LOGIN_TIMEOUT
        while (state := VmConnection.objects.get(vm=vm).state) != "connected":
            if state == "failed" or time.time() > deadline:
                raise RuntimeError(f"{name}: connect {state}")
            time.sleep(0.1)  # the admin watching the VM's page
        connected = time.time()
        for user, _, _ in self.people:
            grant_access(self.admin, self.lab, user, [vm], sudo=False)
        granted = time.time()
        login = self.logins(vm, connected)
        self.hand_vm = vm
        return {
            "total": login - t0, "created": done_at[0] - t0, "imported": imported - t0,
            "connected": connected - t0, "granted": granted - t0, "tries": tries,
        }  # fmt: skip

    def _client(self):
        import grpc
        from google.cloud import tpu_v2
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

        channel = grpc.insecure_channel(
            self.emulator.endpoint, options=[("grpc.enable_http_proxy", 0)]
        )
        return tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel)), tpu_v2

    def _delete_hand_vm(self) -> None:
        """Untimed: the admin deletes the manual VM (the next one is a new import)."""
        from tpus.models import TpuVm
        from tpus.services.vm_lifecycle import delete_vm

        vm = getattr(self, "hand_vm", None)
        if vm is None:
            return
        delete_vm(self.admin, vm, vm.name)
        deadline = time.time() + 120
        while TpuVm.objects.get(pk=vm.pk).missing_since is None:
            if time.time() > deadline:
                raise RuntimeError(f"{vm.name} was not deleted")
            time.sleep(0.2)
        self.hand_vm = None

    # --- the run ------------------------------------------------------------------------

    def run(self) -> None:
        rows = {"a": [], "b": [], "c": []}
        for accelerator_type in self.args.types:
            for rep in range(1, self.args.reps + 1):
                print(f"{accelerator_type} rep {rep}: a …", flush=True)
                a = self.capacity_released(accelerator_type)
                print(f"{accelerator_type} rep {rep}: b …", flush=True)
                b = self.preempted(accelerator_type)
                print(f"{accelerator_type} rep {rep}: c …", flush=True)
                c = self.manual(accelerator_type, rep)
                self._delete_hand_vm()
                print(f"  a {a['total']:.2f} s (reconcile {a['reconcile']:.2f} s), "
                      f"b {b['total']:.2f} s, manual {c['total']:.2f} s", flush=True)  # fmt: skip
                rows["a"].append([accelerator_type, rep, a["total"], a["reconcile"],
                                  a["total"] - a["reconcile"], a["target"],
                                  "yes" if a["total"] <= a["target"] else "no", a["looks"],
                                  a["in_lab"], a["start"], a["end"], a["total"],
                                  a["runs"]])  # fmt: skip
                rows["b"].append([accelerator_type, rep, b["total"], b["target"],
                                  "yes" if b["total"] <= b["target"] else "no", b["noticed"],
                                  b["sent"], b["ready"], b["in_lab"], b["end"],
                                  b["total"], b["runs"]])  # fmt: skip
                rows["c"].append([accelerator_type, rep, c["total"], a["total"],
                                  f"{c['total'] / a['total']:.1f}×", c["created"],
                                  c["imported"], c["connected"], c["granted"], c["total"],
                                  c["tries"]])  # fmt: skip
        self.report(rows)

    def report(self, rows: dict) -> None:
        print()
        print(f"machine: {machine()}")
        print(f"types {self.args.types} ({', '.join(str(n) for n in self.workers.values())} "
              f"workers), {self.args.reps} repetitions, {self.args.people} people; "
              f"PORTAL_SYNC_SECONDS={self.args.sync}, "
              f"PORTAL_VM_REQUEST_POLL_SECONDS={self.args.follow}, "
              f"manual loop pause {self.args.loop_pause} s; seconds")  # fmt: skip
        titles = {
            "a": "a. capacity released → every person logs in on every worker "
            "(target: the reconcile's own time + 5 s; times from the release)",
            "b": "b. preempted → back with everything, capacity there (target: one sync "
            "interval + the create + one reconcile; times from the preemption)",
            "c": "c. the manual way (create loop, import, connect, grant) beside the portal, "
            "from the same release; times from the release",
        }
        for key in ("a", "b", "c"):
            print()
            print(titles[key])
            print()
            print(table(HEADERS[key], rows[key]))
        a, b, c = (median(r[2] for r in rows[key]) for key in ("a", "b", "c"))
        print()
        print(f"medians: a {a:.2f} s, b {b:.2f} s, manual {c:.2f} s ({c / a:.1f}× the portal's a)")

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--types", default="v4-32", help="accelerator types the emulator offers (default v4-32)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions per type (1..20)")
    parser.add_argument("--sync", type=int, default=10, help="PORTAL_SYNC_SECONDS (default 10)")
    parser.add_argument(
        "--follow",
        type=int,
        default=2,
        help="PORTAL_VM_REQUEST_POLL_SECONDS (default 2; production 30)",
    )
    parser.add_argument("--people", type=int, default=2, help="people granted (default 2)")
    parser.add_argument(
        "--loop-pause",
        type=float,
        default=1.0,
        help="seconds between the manual loop's create tries (default 1)",
    )
    args = parser.parse_args(argv)
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    args.reps = max(1, min(args.reps, 20))
    args.sync, args.follow = max(5, args.sync), max(2, args.follow)
    return run_on_fleet(Bench(args))


if __name__ == "__main__":
    sys.exit(main())

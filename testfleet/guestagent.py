"""A stand-in for Google's guest agent: node metadata ``ssh-keys`` → fleet hosts.

On a real TPU VM the guest agent watches the node's metadata and, for every
``user:ssh-ed25519 AAAA… comment`` line of ``ssh-keys``, creates ``user`` with
passwordless sudo (group ``google-sudoers``) and writes its
``~/.ssh/authorized_keys``; a line removed from the metadata takes its keys away. With
``enable-oslogin=TRUE`` (in the node's metadata, or else in the project's) it ignores
``ssh-keys`` altogether. This module does the same for the emulator's nodes on the test
fleet: a node's workers are the fleet hosts whose addresses are its workers' external
IPs. ``apply_once`` is one pass (tests call it); ``GuestAgent`` polls in a thread; and
``python -m testfleet agent --emulator-state PATH`` runs it from the command line.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from testfleet.fleet import Fleet
from testfleet.slots import SlotBusy
from testfleet.system import FleetError
from tpus.emulator.store import Store

log = logging.getLogger(__name__)
# Names the guest agent accepts for accounts (it refuses the rest and logs them).
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
)
_SAFE = re.compile(r"^[\x20-\x7e]+$")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in {"true", "1", "yes", "on"}


def oslogin_enabled(metadata: dict[str, str], project_oslogin: bool) -> bool:
    """The node's ``enable-oslogin`` wins over the project's, as on Compute Engine."""
    if "enable-oslogin" in metadata:
        return _true(metadata["enable-oslogin"])
    return project_oslogin


def key_lines(ssh_keys: str) -> list[tuple[str, str]]:
    """``(user, "type base64 comment")`` for every usable line of an ``ssh-keys`` value;
    lines the agent would skip (bad name, no key, control bytes) are skipped."""
    wanted = []
    for raw in ssh_keys.split("\n"):
        line = raw.strip()
        user, sep, key = line.partition(":")
        words = key.split()
        if not sep or not _USER.match(user) or len(words) < 2 or words[0] not in _KEY_TYPES:
            continue
        if not _SAFE.match(key):
            continue
        wanted.append((user, " ".join(words)))
    return wanted


@dataclass
class AgentPass:
    """What one pass did: per host, the accounts listed for it and their key counts."""

    hosts: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def desired_by_host(fleet: Fleet, state: dict) -> dict[str, dict[str, list[str]]]:
    """``{host: {account: [key lines]}}`` for every fleet host some emulated node's
    worker points at."""
    by_ip = {host.ip: host.name for host in fleet.hosts.values()}
    projects = state.get("projects", {})
    desired: dict[str, dict[str, list[str]]] = {}
    for name, record in sorted(state.get("nodes", {}).items()):
        metadata = record.get("metadata", {})
        project = name.split("/")[1]
        project_oslogin = bool(projects.get(project, {}).get("enable_oslogin", False))
        lines = []
        if not oslogin_enabled(metadata, project_oslogin):
            lines = key_lines(metadata.get("ssh-keys", ""))
        data: dict[str, list[str]] = {}
        for user, key in lines:
            data.setdefault(user, []).append(key)
        for worker in record.get("workers", []):
            host = by_ip.get(worker.get("external_ip") or "")
            if host is not None:
                desired[host] = data
    return desired


def apply_once(fleet: Fleet, state: dict, *, skip: dict | None = None) -> AgentPass:
    """Apply every node's ``ssh-keys`` to its hosts once. ``state`` is the emulator's
    (``Controls.show()``). Hosts whose input equals ``skip[host]`` are left alone."""
    result = AgentPass()
    for host, data in desired_by_host(fleet, state).items():
        if skip is not None and skip.get(host) == data:
            continue
        if not fleet.host(host).running:
            continue
        try:
            fleet.set_ssh_keys(host, data)  # guest-agent.sh: what the real agent does
            result.hosts[host] = {user: len(keys) for user, keys in data.items()}
        except FleetError as exc:  # a host rebooting under us: the next pass retries
            result.errors[host] = str(exc)
            continue
        if skip is not None:
            skip[host] = data
    return result


def offer_hosts(fleet: Fleet, store: Store, names: list[str]) -> None:
    """Offer fleet hosts to the emulator as the machines new TPU VMs are made of."""
    from tpus.emulator.controls import Controls

    controls = Controls(store.path)
    controls.add_hosts(
        [{"ip": fleet.host(n).ip, "name": n, "host_keys": fleet.host_keys(n)} for n in names]
    )


def renew_released(fleet: Fleet, store: Store, prepare=None) -> list[str]:
    """Hosts a deleted or preempted node gave back are made new machines (empty /etc
    and homes, new host keys) and offered again: what Google's fleet does between one
    VM and the next (``prepare(name)``, if given, runs on each before it is offered: an
    image's own files). Returns the names renewed."""
    from tpus.emulator.controls import Controls

    controls = Controls(store.path)
    renewed = []
    for ip, name in sorted(controls.released_hosts().items()):
        if name not in fleet.hosts or fleet.host(name).ip != ip:
            continue
        keys = fleet.renew(name)
        if prepare is not None:
            prepare(name)
        controls.add_hosts([{"ip": ip, "name": name, "host_keys": keys}])
        renewed.append(name)
    return renewed


class GuestAgent:
    """``apply_once`` every ``interval`` seconds in a thread until ``stop()``."""

    def __init__(self, fleet: Fleet, state_file: str | Path, *, interval: float = 0.2):
        self.fleet = fleet
        self.store = Store(state_file)
        self.interval = interval
        self.passes = 0
        self._applied: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="guest-agent", daemon=True)

    def start(self) -> GuestAgent:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop, and return only once the thread has: an agent still running would go
        on writing its nodes' keys onto hosts the next test has taken."""
        self._stop.set()
        self._thread.join(timeout=120)
        if self._thread.is_alive():
            raise FleetError("the guest agent did not stop within 120 s")

    def forget(self) -> None:
        """Apply everything again at the next pass (after a host was rebooted or
        changed by hand)."""
        self._applied.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for name in renew_released(self.fleet, self.store):
                    self._applied.pop(name, None)
                if self._stop.is_set():
                    break
                apply_once(self.fleet, self.store.read(), skip=self._applied)
            except Exception:  # keep polling, as the real agent does
                log.exception("guest agent pass failed")
            self.passes += 1
            self._stop.wait(self.interval)


def run_forever(slot: int, state_file: str | Path, *, interval: float = 1.0, once: bool = False):
    """The command line's loop. The fleet's slot is claimed for each pass only, so
    ``python -m testfleet move/reboot …`` keep working while the agent runs."""
    store = Store(state_file)
    applied: dict = {}
    stop = threading.Event()
    while True:
        try:
            with Fleet.open(slot) as fleet:
                for name in renew_released(fleet, store):
                    applied.pop(name, None)
                    print(f"{name}: made a new machine (new host keys, empty /etc and homes)")
                done = apply_once(fleet, store.read(), skip=None if once else applied)
        except SlotBusy:
            done = AgentPass()
        for host, counts in sorted(done.hosts.items()):
            print(f"{host}: " + (", ".join(f"{u} ({n} keys)" for u, n in counts.items()) or "-"))
        for host, error in sorted(done.errors.items()):
            print(f"{host}: {error}")
        if once:
            return
        stop.wait(interval)

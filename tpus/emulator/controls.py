"""Controls for the emulated lab: add nodes and disks, move IPs, start maintenance,
preempt, delete, set node metadata and project settings, make the next calls fail, and
make one project's calls slow.
The command line and the tests both use these; each call is one transaction on the
state file, so a running server sees the change at its next request.

Nodes are named by their short id (``tpu5``) when that is unique, or by their full
resource name (``projects/p/locations/z/nodes/tpu5``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from google.cloud import tpu_v2

from tpus.emulator import hostpool, queued
from tpus.emulator.catalog import ACCELERATOR, TOPOLOGIES, default_workers
from tpus.emulator.store import State, Store

STATES = {s.name for s in tpu_v2.Node.State}
HEALTHS = {h.name for h in tpu_v2.Node.Health}
DISK_MODES = ("READ_WRITE", "READ_ONLY")
# gRPC codes a test may inject; OK would not be a failure.
FAULT_CODES = {c.name for c in grpc.StatusCode if c is not grpc.StatusCode.OK}

# Documentation/benchmark ranges (RFC 1918 inside, RFC 2544 outside): the emulator
# only reports these addresses, and nothing routes them anywhere real.
_FIRST_INTERNAL = ipaddress.IPv4Address("10.128.0.2")
_FIRST_EXTERNAL = ipaddress.IPv4Address("198.18.0.1")


class ControlError(ValueError):
    """A control was asked for something the emulated lab cannot do."""


def node_name(project: str, zone: str, node_id: str) -> str:
    return f"projects/{project}/locations/{zone}/nodes/{node_id}"


def disk_path(project: str, zone: str, name: str) -> str:
    return f"projects/{project}/zones/{zone}/disks/{name}"


def new_host_key() -> str:
    """A fresh ed25519 public key, base64 only, as the guest agent publishes it."""
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return line.decode().split()[1]


def next_ip(state: State, kind: str) -> str:
    counters = state["counters"]
    n = counters[kind]
    counters[kind] = n + 1
    first = _FIRST_INTERNAL if kind == "internal_ip" else _FIRST_EXTERNAL
    return str(first + n)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def find_node(state: State, node: str) -> tuple[str, dict[str, Any]]:
    """The (full name, record) of ``node``, a short id or a full resource name."""
    nodes = state["nodes"]
    if node in nodes:
        return node, nodes[node]
    matches = [name for name in nodes if name.rsplit("/", 1)[-1] == node]
    if len(matches) == 1:
        return matches[0], nodes[matches[0]]
    if not matches:
        raise ControlError(f"no node {node!r}")
    raise ControlError(f"{node!r} is ambiguous; use one of: {', '.join(sorted(matches))}")


def _check_ip(ip: str) -> str:
    if ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise ControlError(f"{ip!r} is not an IP address") from None
    return ip


_METADATA_KEY = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
# Compute Engine's limit for one value; the total is 512 KB.
_METADATA_VALUE_MAX = 256 * 1024


def _checked_metadata(values: Mapping[str, str | None], *, allow_none: bool = False) -> dict:
    checked: dict[str, str | None] = {}
    for key, value in values.items():
        if not _METADATA_KEY.match(key):
            raise ControlError(f"metadata key {key!r}: letters, digits, - and _ only")
        if value is None and allow_none:
            checked[key] = None
            continue
        if not isinstance(value, str):
            raise ControlError(f"metadata value of {key!r} must be a string")
        if len(value.encode()) > _METADATA_VALUE_MAX:
            raise ControlError(f"metadata value of {key!r} is longer than 256 KB")
        checked[key] = value
    return checked


def _merged(current: dict[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    merged = dict(current)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def apply_metadata_after_get(record: dict[str, Any]) -> bool:
    """Apply a pending ``change_metadata_after_next_get``; True when there was one."""
    pending = record.pop("metadata_after_get", None)
    if pending is None:
        return False
    record["metadata"] = _merged(record.get("metadata", {}), pending)
    return True


class Controls:
    """The emulated lab behind one state file."""

    def __init__(self, state_file: str | os.PathLike[str]):
        self.store = Store(state_file)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Run many controls as one transaction (one write of the state file)."""
        with self.store.transaction():
            yield

    def show(self) -> State:
        return self.store.read()

    # -- nodes ----------------------------------------------------------------------

    def add_node(
        self,
        project: str,
        zone: str,
        node_id: str,
        *,
        accelerator_type: str = "v4-8",
        workers: int | None = None,
        topology: str | None = None,
        runtime_version: str = "tpu-ubuntu2204-base",
        internal_ips: Sequence[str] = (),
        external_ips: Sequence[str] = (),
        host_keys: Mapping[int, Mapping[str, str]] | None = None,
        generate_host_keys: bool = True,
        labels: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        state: str = "READY",
        health: str = "HEALTHY",
        preemptible: bool = False,
        spot: bool = False,
    ) -> str:
        """Add a node; unspecified IPs are handed out from reserved ranges and each
        worker gets an ed25519 host key unless ``host_keys`` names its keys."""
        count = workers if workers is not None else default_workers(accelerator_type)
        if count < 1:
            raise ControlError("a node has at least one worker")
        for given, what in ((internal_ips, "internal"), (external_ips, "external")):
            if given and len(given) != count:
                raise ControlError(f"{count} workers need {count} {what} IPs, got {len(given)}")
        if state not in STATES or health not in HEALTHS:
            raise ControlError(f"unknown state/health {state}/{health}")
        host_keys = host_keys or {}
        if any(not 0 <= int(w) < count for w in host_keys):
            raise ControlError(f"host keys name a worker outside 0..{count - 1}")
        name = node_name(project, zone, node_id)
        with self.store.transaction() as data:
            if name in data["nodes"]:
                raise ControlError(f"{name} already exists")
            if not internal_ips and not external_ips and not host_keys:
                try:
                    taken = hostpool.take(data, name, count)
                except LookupError as exc:
                    raise ControlError(f"no hosts for {name}: {exc}") from None
                if taken is not None:
                    internal_ips = external_ips = [ip for ip, _ in taken]
                    host_keys = {i: keys for i, (_, keys) in enumerate(taken)}
            data["counters"]["node_id"] += 1
            data["nodes"][name] = {
                "id": 7_000_000_000 + data["counters"]["node_id"],
                "accelerator_type": accelerator_type,
                "topology": TOPOLOGIES.get(accelerator_type, "") if topology is None else topology,
                "runtime_version": runtime_version,
                "state": state,
                "health": health,
                "health_description": "",
                "labels": dict(labels or {}),
                "metadata": _checked_metadata(metadata or {}),
                "preemptible": preemptible,
                "spot": spot,
                "create_time": _now(),
                "data_disks": [],
                "workers": [
                    {
                        "internal_ip": _check_ip(internal_ips[i])
                        if internal_ips
                        else next_ip(data, "internal_ip"),
                        "external_ip": _check_ip(external_ips[i])
                        if external_ips
                        else next_ip(data, "external_ip"),
                        "host_keys": dict(host_keys.get(i, {}))
                        or ({"ssh-ed25519": new_host_key()} if generate_host_keys else {}),
                    }
                    for i in range(count)
                ],
            }
        return name

    def _update(self, node: str, change) -> dict[str, Any]:
        with self.store.transaction() as data:
            _, record = find_node(data, node)
            change(record)
            return record

    @staticmethod
    def _worker(record: dict[str, Any], worker: int) -> dict[str, Any]:
        if not 0 <= worker < len(record["workers"]):
            raise ControlError(f"no worker {worker}; the node has {len(record['workers'])}")
        return record["workers"][worker]

    def set_ip(self, node: str, worker: int, ip: str, *, internal: bool = False) -> None:
        """Give a worker a new external IP (or internal, with ``internal=True``)."""
        key = "internal_ip" if internal else "external_ip"
        ip = _check_ip(ip)

        def change(record):
            self._worker(record, worker)[key] = ip

        self._update(node, change)

    def set_host_key(self, node: str, worker: int, key_type: str, value: str) -> None:
        """Publish ``value`` (base64, or "type base64") under ``hostkeys/<key_type>``."""

        def change(record):
            self._worker(record, worker)["host_keys"][key_type] = value

        self._update(node, change)

    def set_state(self, node: str, *, state: str | None = None, health: str | None = None) -> None:
        if state is not None and state not in STATES:
            raise ControlError(f"unknown state {state}; one of {', '.join(sorted(STATES))}")
        if health is not None and health not in HEALTHS:
            raise ControlError(f"unknown health {health}; one of {', '.join(sorted(HEALTHS))}")

        def change(record):
            record["state"] = state or record["state"]
            record["health"] = health or record["health"]

        self._update(node, change)

    def maintenance(self, node: str) -> None:
        """A maintenance event begins: unhealthy, and the external IPs are gone."""

        def change(record):
            record["health"] = "UNHEALTHY_MAINTENANCE"
            record["health_description"] = "The TPU is undergoing a maintenance event."
            for worker in record["workers"]:
                worker["external_ip"] = ""

        self._update(node, change)

    def end_maintenance(self, node: str, external_ips: Sequence[str] = ()) -> None:
        """The event is over: READY and HEALTHY, with new external IPs (given or fresh)."""
        with self.store.transaction() as data:
            _, record = find_node(data, node)
            if external_ips and len(external_ips) != len(record["workers"]):
                raise ControlError(f"give one external IP per worker ({len(record['workers'])})")
            record.update(state="READY", health="HEALTHY", health_description="")
            for i, worker in enumerate(record["workers"]):
                worker["external_ip"] = (
                    _check_ip(external_ips[i]) if external_ips else next_ip(data, "external_ip")
                )

    def preempt(self, node: str) -> None:
        """Google takes a spot or preemptible node back: PREEMPTED, its external IPs
        gone, and the queued resource it came from (if any) SUSPENDED."""
        with self.store.transaction() as data:
            name, record = find_node(data, node)
            record.update(state="PREEMPTED", health="HEALTH_UNSPECIFIED")
            for worker in record["workers"]:
                worker["external_ip"] = ""
            hostpool.release(data, name)  # the machines go back to Google
            owner = queued.request_of_node(data, name)
            if owner is not None:
                owner[1].update(state="SUSPENDED", state_initiator="SERVICE")

    # -- capacity and queued resources ------------------------------------------------

    def set_capacity(self, zone: str, accelerator_type: str, nodes: int | None) -> None:
        """At most ``nodes`` nodes of this type in this zone at once (0: a stockout);
        None lifts the limit. Waiting queued resources are provisioned at the next call."""
        if nodes is not None and nodes < 0:
            raise ControlError("capacity is a number of nodes, 0 or more")
        if not ACCELERATOR.match(accelerator_type):
            raise ControlError(f"unknown accelerator type {accelerator_type!r}")
        with self.store.transaction() as data:
            zones = queued.capacity(data)
            if nodes is None:
                zones.get(zone, {}).pop(accelerator_type, None)
            else:
                zones.setdefault(zone, {})[accelerator_type] = nodes

    def fail_request(self, request: str, code: str, message: str) -> None:
        """A queued resource fails as the API fails one (quota, stockout past its
        window, a bad version): FAILED with this gRPC ``code`` and ``message``."""
        code = code.upper()
        if code not in FAULT_CODES:
            raise ControlError(f"unknown gRPC code {code}; one of {', '.join(sorted(FAULT_CODES))}")
        with self.store.transaction() as data:
            name, record = self._request(data, request)
            record.update(
                state="FAILED",
                state_initiator="SERVICE",
                error={"code": code, "message": message},
            )
            hostpool.drop_node(data, record.pop("node_name", None))

    # -- hosts new nodes are made of ---------------------------------------------------

    def add_hosts(self, hosts: Sequence[Mapping[str, Any]]) -> None:
        """Offer hosts for new nodes: each ``{"ip", "name", "host_keys": ["type
        base64", …]}``. An address offered again is made free with the keys given (it
        was made new)."""
        with self.store.transaction() as data:
            for host in hosts:
                ip = _check_ip(host["ip"])
                keys = {line.split()[0]: line for line in host["host_keys"]}
                current = hostpool.pool(data).get(ip)
                if current is not None and current["state"] == hostpool.USED:
                    raise ControlError(f"{ip} is a worker of {current['node']}")
                hostpool.pool(data)[ip] = {
                    "name": host.get("name", ip),
                    "host_keys": keys,
                    "state": hostpool.FREE,
                    "node": None,
                }

    def released_hosts(self) -> dict[str, str]:
        """Hosts given back by deleted or preempted nodes: address → name."""
        return {
            ip: host["name"]
            for ip, host in hostpool.pool(self.store.read()).items()
            if host["state"] == hostpool.RELEASED
        }

    def queued_resources(self) -> dict[str, dict[str, Any]]:
        return dict(queued.requests(self.store.read()))

    @staticmethod
    def _request(data: State, request: str) -> tuple[str, dict[str, Any]]:
        found = queued.requests(data)
        if request in found:
            return request, found[request]
        matches = [n for n in found if n.rsplit("/", 1)[-1] == request]
        if len(matches) != 1:
            raise ControlError(
                f"no queued resource {request!r}" if not matches else f"{request!r} is ambiguous"
            )
        return matches[0], found[matches[0]]

    def delete(self, node: str) -> None:
        with self.store.transaction() as data:
            name, _ = find_node(data, node)
            hostpool.drop_node(data, name)

    # -- metadata and project settings ----------------------------------------------

    def metadata(self, node: str) -> dict[str, str]:
        """A node's metadata, as ``GetNode`` shows it."""
        _, record = find_node(self.store.read(), node)
        return dict(record.get("metadata", {}))

    def set_metadata(
        self, node: str, values: Mapping[str, str | None], *, replace: bool = False
    ) -> dict[str, str]:
        """Set metadata keys (a None value removes the key), or with ``replace`` make
        ``values`` the whole map; as a change made outside the portal would."""
        checked = _checked_metadata(values, allow_none=True)

        def change(record):
            current = {} if replace else dict(record.get("metadata", {}))
            record["metadata"] = _merged(current, checked)

        return dict(self._update(node, change)["metadata"])

    def change_metadata_after_next_get(self, node: str, values: Mapping[str, str | None]) -> None:
        """Right after the next GetNode of ``node`` has been read, apply ``values`` (as
        ``set_metadata``): a change made by someone else between a client's read and
        its write, to test that a read-modify-write notices it."""
        checked = _checked_metadata(values, allow_none=True)

        def change(record):
            record["metadata_after_get"] = checked

        self._update(node, change)

    def deny_update(self, node: str, denied: bool = True) -> None:
        """UpdateNode of this node answers PERMISSION_DENIED (the caller lacks
        ``tpu.nodes.update``), until called again with ``denied=False``."""

        def change(record):
            record["deny_update"] = denied

        self._update(node, change)

    def set_oslogin(self, project: str, enabled: bool = True) -> None:
        """Turn OS Login on or off for a whole project. Real projects do this with
        ``enable-oslogin`` in Compute Engine project metadata, which the TPU API does
        not show; only the guest agent on the workers sees it."""
        with self.store.transaction() as data:
            settings = data.setdefault("projects", {}).setdefault(project, {})
            settings["enable_oslogin"] = enabled

    def oslogin_enabled(self, project: str) -> bool:
        return bool(
            self.store.read().get("projects", {}).get(project, {}).get("enable_oslogin", False)
        )

    # -- disks ----------------------------------------------------------------------

    def add_disk(self, project: str, zone: str, name: str, *, size_gb: int = 100) -> str:
        path = disk_path(project, zone, name)
        with self.store.transaction() as data:
            data["disks"].setdefault(path, {"size_gb": size_gb})
        return path

    def attach(self, node: str, disk: str, mode: str = "READ_ONLY") -> None:
        """Attach a disk without going through the API (to set a scene up)."""
        if mode not in DISK_MODES:
            raise ControlError(f"mode is one of {DISK_MODES}")
        with self.store.transaction() as data:
            name, record = find_node(data, node)
            project, _, zone = name.split("/")[1:4]
            path = disk if disk.startswith("projects/") else disk_path(project, zone, disk)
            data["disks"].setdefault(path, {"size_gb": 100})
            if not any(d["source_disk"] == path for d in record["data_disks"]):
                record["data_disks"].append({"source_disk": path, "mode": mode})

    # -- faults ---------------------------------------------------------------------

    def fail(self, count: int, code: str, *, method: str | None = None) -> None:
        """The next ``count`` calls (of ``method`` only, if given) answer ``code``."""
        code = code.upper()
        if code not in FAULT_CODES:
            raise ControlError(f"unknown gRPC code {code}; one of {', '.join(sorted(FAULT_CODES))}")
        if count < 1:
            raise ControlError("count must be at least 1")
        with self.store.transaction() as data:
            data["faults"].append({"code": code, "method": method, "remaining": count})

    def clear_faults(self) -> None:
        with self.store.transaction() as data:
            data["faults"] = []
            data["slow"] = {}

    def slow(self, project: str, seconds: float) -> None:
        """Every call about ``project`` answers ``seconds`` late (0: at once again);
        past the caller's timeout, the call fails with DEADLINE_EXCEEDED."""
        if seconds < 0:
            raise ControlError("seconds must be 0 or more")
        with self.store.transaction() as data:
            slow = data.setdefault("slow", {})
            if seconds:
                slow[project] = seconds
            else:
                slow.pop(project, None)

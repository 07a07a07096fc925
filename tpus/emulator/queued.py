"""Capacity and queued resources in the emulated lab.

A zone holds at most ``capacity[zone][accelerator_type]`` nodes of a type at once
(no entry: as many as asked for). Nodes that are preempted, terminated or stopped hold
none. ``CreateNode`` past the capacity is refused with RESOURCE_EXHAUSTED, the words
Google uses for a stockout; a queued resource (``CreateQueuedResource``) waits instead:

    ACCEPTED → WAITING_FOR_RESOURCES → PROVISIONING → ACTIVE

It moves on whenever the state is looked at (any call, or ``advance``): it is provisioned
once its zone has room (in the order the requests came, after its ``valid_after_time``),
and FAILED once its ``valid_until_time`` passed first. A spot or preemptible node that
is preempted leaves its request SUSPENDED; ``ResetQueuedResource`` puts a suspended or
failed request back in line, and deleting a request deletes its node too when asked to
(``force``), as the real API does.

Request records live in ``state["queued_resources"]`` by full name:
``{node_id, node: {...node fields...}, spot, guaranteed, valid_after, valid_until,
state, error: {code, message} | None, create_time, provisioned_at}``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from grpc import StatusCode

from tpus.emulator import disks as emulated_disks
from tpus.emulator import hostpool
from tpus.emulator.catalog import ACCELERATOR_TYPES, RUNTIME_VERSIONS, default_workers
from tpus.emulator.store import State

ALREADY_EXISTS = StatusCode.ALREADY_EXISTS
FAILED_PRECONDITION = StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = StatusCode.INVALID_ARGUMENT
NOT_FOUND = StatusCode.NOT_FOUND
_ID = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUEUED = re.compile(r"^projects/([^/]+)/locations/([^/]+)/queuedResources/([^/]+)$")

# Nodes in these states hold no capacity.
IDLE_STATES = {"PREEMPTED", "TERMINATED", "STOPPED", "STOPPING", "DELETING"}
WAITING = ("ACCEPTED", "WAITING_FOR_RESOURCES")
STOCKOUT = (
    'There is no more capacity in the zone "{zone}"; you can try in another zone where '
    "Cloud TPU Nodes are offered (see https://cloud.google.com/tpu/docs/regions) "
    "[EID: 0x{eid:016x}]"
)
EXPIRED = (
    "The queued resource's valid_until time passed before capacity for {type} in {zone} "
    "could be found."
)


def now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if moment else ""


def parse(text: str) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def requests(state: State) -> dict[str, dict[str, Any]]:
    return state.setdefault("queued_resources", {})


def capacity(state: State) -> dict[str, dict[str, int]]:
    return state.setdefault("capacity", {})


def in_use(state: State, zone: str, accelerator_type: str) -> int:
    """Nodes of a type that hold the zone's capacity now."""
    return sum(
        1
        for name, record in state["nodes"].items()
        if name.split("/")[3] == zone
        and record["accelerator_type"] == accelerator_type
        and record["state"] not in IDLE_STATES
    )


def has_room(state: State, zone: str, accelerator_type: str) -> bool:
    """Room for one more node of a type in a zone: under its capacity, and with
    enough free hosts when hosts are offered."""
    if not hostpool.enough(state, default_workers(accelerator_type)):
        return False
    limit = capacity(state).get(zone, {}).get(accelerator_type)
    return limit is None or in_use(state, zone, accelerator_type) < limit


def stockout_message(state: State, zone: str) -> str:
    counters = state["counters"]
    counters["stockout"] = counters.get("stockout", 0) + 1
    return STOCKOUT.format(zone=zone, eid=0x5EED0000 + counters["stockout"])


def zone_of(name: str) -> str:
    return name.split("/")[3]


def advance(state: State, create_node) -> bool:
    """Move every request on as far as the lab allows now. ``create_node(state, request
    name, record)`` makes the node of a request that got capacity (False when it failed
    the request instead). True if anything changed (the caller then writes the
    state)."""
    changed = False
    moment = now()
    for name in sorted(requests(state), key=lambda n: (requests(state)[n]["create_time"], n)):
        record = requests(state)[name]
        if record["state"] == "ACCEPTED":
            record["state"] = "WAITING_FOR_RESOURCES"
            changed = True
        if record["state"] == "PROVISIONING":
            record["state"] = "ACTIVE"
            changed = True
            continue
        if record["state"] != "WAITING_FOR_RESOURCES":
            continue
        until = parse(record.get("valid_until", ""))
        if until is not None and moment >= until:
            record["state"] = "FAILED"
            record["error"] = {
                "code": "DEADLINE_EXCEEDED",
                "message": EXPIRED.format(
                    type=record["node"]["accelerator_type"], zone=zone_of(name)
                ),
            }
            changed = True
            continue
        after = parse(record.get("valid_after", ""))
        if after is not None and moment < after:
            continue
        if record.get("held") or not has_room(
            state, zone_of(name), record["node"]["accelerator_type"]
        ):
            continue
        changed = True
        if create_node(state, name, record) is False:
            continue  # refused when it got capacity; the request says why
        record["state"] = "PROVISIONING"
        record["provisioned_at"] = iso(moment)
        changed = True
    return changed


def request_of_node(state: State, node_name: str) -> tuple[str, dict[str, Any]] | None:
    """The queued resource whose node this is, if any."""
    for name, record in requests(state).items():
        if record.get("node_name") == node_name:
            return name, record
    return None


# --- the API's calls ------------------------------------------------------------------


def render(types, name: str, record: dict[str, Any]):
    """The ``types.QueuedResource`` message of a stored request."""
    from google.rpc import status_pb2

    project, zone = name.split("/")[1], zone_of(name)
    spec = record["node"]
    node = types.Node(
        accelerator_type=spec["accelerator_type"],
        runtime_version=spec["runtime_version"],
        labels=spec.get("labels", {}),
        metadata=spec.get("metadata", {}),
        scheduling_config=types.SchedulingConfig(
            preemptible=spec.get("preemptible", False), spot=spec.get("spot", False)
        ),
        data_disks=[
            types.AttachedDisk(
                source_disk=d["source_disk"], mode=types.AttachedDisk.DiskMode[d["mode"]]
            )
            for d in spec.get("data_disks", [])
        ],
    )
    state = types.QueuedResourceState(
        state=types.QueuedResourceState.State[record["state"]],
        state_initiator=types.QueuedResourceState.StateInitiator[
            record.get("state_initiator", "USER")
        ],
    )
    if record["state"] == "FAILED" and record.get("error"):
        error = record["error"]
        state.failed_data = types.QueuedResourceState.FailedData(
            error=status_pb2.Status(
                code=StatusCode[error["code"]].value[0], message=error["message"]
            )
        )
    message = types.QueuedResource(
        name=name,
        create_time=parse(record["create_time"]),
        tpu=types.QueuedResource.Tpu(
            node_spec=[
                types.QueuedResource.Tpu.NodeSpec(
                    parent=f"projects/{project}/locations/{zone}",
                    node_id=record["node_id"],
                    node=node,
                )
            ]
        ),
        state=state,
    )
    if record.get("spot"):
        message.spot = types.QueuedResource.Spot()
    if record.get("guaranteed"):
        message.guaranteed = types.QueuedResource.Guaranteed()
    policy = {}
    if record.get("valid_until"):
        policy["valid_until_time"] = parse(record["valid_until"])
    if record.get("valid_after"):
        policy["valid_after_time"] = parse(record["valid_after"])
    if policy:
        message.queueing_policy = types.QueuedResource.QueueingPolicy(**policy)
    return message


def window(policy, moment: datetime) -> tuple[str, str]:
    """(valid_after, valid_until) of a request's queueing policy, as stored times."""
    after = until = None
    if "valid_after_time" in policy:
        after = policy.valid_after_time
    elif "valid_after_duration" in policy:
        after = moment + policy.valid_after_duration
    if "valid_until_time" in policy:
        until = policy.valid_until_time
    elif "valid_until_duration" in policy:
        until = moment + policy.valid_until_duration
    if "valid_interval" in policy:
        interval = policy.valid_interval  # google.type.Interval, a plain protobuf
        if interval.HasField("start_time"):
            after = interval.start_time.ToDatetime(tzinfo=UTC)
        if interval.HasField("end_time"):
            until = interval.end_time.ToDatetime(tzinfo=UTC)
    return iso(after), iso(until)


class QueuedResourceCalls:
    """The queued resource RPCs of ``TpuEmulator`` (which mixes this in): it has
    ``store``, ``controls``, ``operations``, ``_finish_queued`` and ``Abort``."""

    def _advance(self) -> State:
        """The state with every request moved on; written back only when it changed."""
        state = self.store.read()
        if not any(r["state"] in (*WAITING, "PROVISIONING") for r in requests(state).values()):
            return state
        with self.store.transaction() as data:
            advance(data, self._provision)
            return data

    def _provision(self, data: State, name: str, record: dict[str, Any]) -> bool:
        project, zone = name.split("/")[1], zone_of(name)
        spec = record["node"]
        # The node comes with the disks asked for, checked as an attach is when it is
        # made (a read-write disk another VM took meanwhile fails the request).
        try:
            disks = emulated_disks.checked(
                data,
                f"projects/{project}/locations/{zone}/nodes/{record['node_id']}",
                [(d["source_disk"], d["mode"]) for d in spec.get("data_disks", [])],
            )
        except emulated_disks.DiskRefused as exc:
            record.update(state="FAILED", error={"code": exc.code.name, "message": exc.message})
            return False
        node = self.controls.add_node(
            project,
            zone,
            record["node_id"],
            accelerator_type=spec["accelerator_type"],
            runtime_version=spec["runtime_version"],
            labels=spec.get("labels", {}),
            metadata=spec.get("metadata", {}),
            preemptible=spec.get("preemptible", False),
            spot=spec.get("spot", False) or record.get("spot", False),
        )
        data["nodes"][node]["data_disks"] = disks
        record["node_name"] = node
        return True

    def _queued(self, state: State, name: str) -> dict[str, Any]:
        if not _QUEUED.match(name):
            raise self.Abort(INVALID_ARGUMENT, f"Malformed queued resource name '{name}'")
        record = requests(state).get(name)
        if record is None:
            raise self.Abort(NOT_FOUND, f"Resource '{name}' was not found")
        return record

    def list_queued_resources(self, types, request, context):
        project, zone = self._parent(request.parent)
        state = self._advance()
        prefix = f"projects/{project}/locations/"
        names = sorted(
            n
            for n in requests(state)
            if n.startswith(prefix) and (zone == "-" or zone_of(n) == zone)
        )
        chunk, token = self._page(names, request.page_size, request.page_token)
        return types.ListQueuedResourcesResponse(
            queued_resources=[render(types, n, requests(state)[n]) for n in chunk],
            next_page_token=token,
        )

    def get_queued_resource(self, types, request, context):
        state = self._advance()
        return render(types, request.name, self._queued(state, request.name))

    def create_queued_resource(self, types, request, context):
        project, zone = self._parent(request.parent)
        resource_id = request.queued_resource_id
        if not _ID.match(resource_id or ""):
            raise self.Abort(INVALID_ARGUMENT, f"Invalid queued_resource_id '{resource_id}'")
        wanted = request.queued_resource
        specs = list(wanted.tpu.node_spec)
        if len(specs) != 1:
            raise self.Abort(INVALID_ARGUMENT, "tpu.node_spec must name exactly one node")
        spec = specs[0]
        if spec.parent != request.parent:
            raise self.Abort(INVALID_ARGUMENT, f"node_spec.parent must be {request.parent}")
        if not _ID.match(spec.node_id or ""):
            raise self.Abort(INVALID_ARGUMENT, f"Invalid node_id '{spec.node_id}'")
        node = spec.node
        if not node.accelerator_type:
            raise self.Abort(INVALID_ARGUMENT, "node.accelerator_type is required")
        if not node.runtime_version:
            raise self.Abort(INVALID_ARGUMENT, "node.runtime_version is required")
        name = f"{request.parent}/queuedResources/{resource_id}"
        moment = now()
        after, until = window(wanted.queueing_policy, moment)
        with self.store.transaction() as data:
            if name in requests(data):
                raise self.Abort(ALREADY_EXISTS, f"Resource '{name}' already exists")
            node_name = f"{request.parent}/nodes/{spec.node_id}"
            if node_name in data["nodes"] or any(
                other.startswith(request.parent + "/") and r["node_id"] == spec.node_id
                for other, r in requests(data).items()
            ):
                raise self.Abort(ALREADY_EXISTS, f"Resource '{node_name}' already exists")
            record = {
                "node_id": spec.node_id,
                "node": {
                    "accelerator_type": node.accelerator_type,
                    "runtime_version": node.runtime_version,
                    "labels": dict(node.labels),
                    "metadata": dict(node.metadata),
                    "preemptible": node.scheduling_config.preemptible,
                    "spot": node.scheduling_config.spot,
                    "data_disks": [
                        {
                            "source_disk": d.source_disk,
                            "mode": "READ_ONLY" if d.mode.name == "READ_ONLY" else "READ_WRITE",
                        }
                        for d in node.data_disks
                    ],
                },
                "spot": "spot" in wanted,
                "guaranteed": "guaranteed" in wanted,
                "valid_after": after,
                "valid_until": until,
                "state": "ACCEPTED",
                "state_initiator": "USER",
                "error": None,
                "create_time": iso(moment),
            }
            problem = self._refusal(node)
            if problem:
                record.update(
                    state="FAILED", error={"code": "INVALID_ARGUMENT", "message": problem}
                )
            requests(data)[name] = record
            result = render(types, name, record)
        return self.operations.start(types, project, zone, name, "create", result)

    def _refusal(self, node) -> str:
        """What the API fails a request for once it looks at it (not at the call)."""
        if node.accelerator_type not in ACCELERATOR_TYPES:
            return f"Accelerator type '{node.accelerator_type}' is not available in this zone."
        if node.runtime_version not in RUNTIME_VERSIONS:
            return f"Runtime version '{node.runtime_version}' was not found."
        return ""

    def delete_queued_resource(self, types, request, context):
        with self.store.transaction() as data:
            record = self._queued(data, request.name)
            node = record.get("node_name")
            if node in data["nodes"]:
                if not request.force:
                    raise self.Abort(
                        FAILED_PRECONDITION,
                        f"Queued resource '{request.name}' has node '{node}': delete the node "
                        "first, or delete the queued resource with force.",
                    )
                hostpool.drop_node(data, node)
            del requests(data)[request.name]
        project, zone = request.name.split("/")[1], zone_of(request.name)
        return self.operations.start(types, project, zone, request.name, "delete", None)

    def reset_queued_resource(self, types, request, context):
        with self.store.transaction() as data:
            record = self._queued(data, request.name)
            if record["state"] not in ("SUSPENDED", "FAILED", "ACTIVE"):
                raise self.Abort(
                    FAILED_PRECONDITION,
                    f"Queued resource '{request.name}' is {record['state']}; only an active, "
                    "suspended or failed one can be reset.",
                )
            hostpool.drop_node(data, record.pop("node_name", None))
            record.update(state="WAITING_FOR_RESOURCES", state_initiator="USER", error=None)
            advance(data, self._provision)
            result = render(types, request.name, record)
        project, zone = request.name.split("/")[1], zone_of(request.name)
        return self.operations.start(types, project, zone, request.name, "reset", result)

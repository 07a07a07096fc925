"""The Cloud TPU API over gRPC: ``google.cloud.tpu.v2.Tpu``, the part of
``google.cloud.tpu.v2alpha1.Tpu`` the portal uses, and ``google.longrunning.Operations``.

Handlers are generic (no generated servicer code): each method is registered with the
request and response classes shipped in google-cloud-tpu, whose proto-plus
``serialize``/``deserialize`` speak the wire format. A method not registered here is
answered UNIMPLEMENTED by gRPC itself.
"""

from __future__ import annotations

import base64
import bisect
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc
from google.cloud import tpu_v2, tpu_v2alpha1
from google.longrunning import operations_pb2

from tpus.emulator import disks as emulated_disks
from tpus.emulator import hostpool, queued
from tpus.emulator.catalog import ACCELERATOR_TYPES, RUNTIME_VERSIONS
from tpus.emulator.controls import (
    ControlError,
    Controls,
    apply_metadata_after_get,
    new_host_key,
    next_ip,
)
from tpus.emulator.operations import OperationBook
from tpus.emulator.render import render_node, split_node_name
from tpus.emulator.store import State

_NODE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/nodes/([^/]+)$")
_PARENT = re.compile(r"^projects/([^/]+)/locations/([^/]+)$")
_PROJECT = re.compile(r"^projects/([^/]+)/")
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# v2's documented UpdateNode masks leave data disks out; gcloud attaches disks through
# v2alpha1 with update_mask=data_disks, and so does the portal.
# Metadata is replaced as a whole map, as the real API does.
_UPDATABLE = {
    "v2": {"labels", "description", "metadata"},
    "v2alpha1": {"labels", "description", "data_disks", "metadata"},
}


class Abort(Exception):
    """Answer the current call with this status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _not_found(name: str) -> Abort:
    return Abort(grpc.StatusCode.NOT_FOUND, f"Resource '{name}' was not found")


def _page(names: list[str], page_size: int, page_token: str) -> tuple[list[str], str]:
    """One page of sorted ``names``; the token names the last item already returned,
    so paging stays correct when nodes come and go between pages."""
    size = page_size or DEFAULT_PAGE_SIZE
    if size < 0:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "page_size must not be negative")
    size = min(size, MAX_PAGE_SIZE)
    start = 0
    if page_token:
        try:
            after = base64.b64decode(page_token, altchars=b"-_", validate=True).decode()
        except ValueError:
            after = ""
        if not after.startswith("projects/"):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid page_token")
        start = bisect.bisect_right(names, after)
    chunk = names[start : start + size]
    more = start + size < len(names)
    token = base64.urlsafe_b64encode(chunk[-1].encode()).decode() if more and chunk else ""
    return chunk, token


def _parent(parent: str) -> tuple[str, str]:
    match = _PARENT.match(parent)
    if not match:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Malformed parent '{parent}'")
    return match.group(1), match.group(2)


class TpuEmulator(queued.QueuedResourceCalls):
    """Serves the API from the state file behind ``controls``."""

    Abort = Abort
    _parent = staticmethod(_parent)
    _page = staticmethod(_page)

    def __init__(self, controls: Controls, *, operation_delay: float = 0.0):
        self.controls = controls
        self.store = controls.store
        self.operations = OperationBook(operation_delay)
        # Calls answered, by method name ("ListNodes"), faults included.
        self.requests: Counter[str] = Counter()
        self._requests_lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        v2 = {
            "ListNodes": (self.list_nodes, "ListNodesRequest", "ListNodesResponse"),
            "GetNode": (self.get_node, "GetNodeRequest", "Node"),
            "CreateNode": (self.create_node, "CreateNodeRequest", None),
            "DeleteNode": (self.delete_node, "DeleteNodeRequest", None),
            "StartNode": (self.start_node, "StartNodeRequest", None),
            "StopNode": (self.stop_node, "StopNodeRequest", None),
            "UpdateNode": (self.update_node, "UpdateNodeRequest", None),
            "GetGuestAttributes": (
                self.guest_attributes,
                "GetGuestAttributesRequest",
                "GetGuestAttributesResponse",
            ),
            "ListQueuedResources": (
                self.list_queued_resources,
                "ListQueuedResourcesRequest",
                "ListQueuedResourcesResponse",
            ),
            "GetQueuedResource": (
                self.get_queued_resource,
                "GetQueuedResourceRequest",
                "QueuedResource",
            ),
            "CreateQueuedResource": (
                self.create_queued_resource,
                "CreateQueuedResourceRequest",
                None,
            ),
            "DeleteQueuedResource": (
                self.delete_queued_resource,
                "DeleteQueuedResourceRequest",
                None,
            ),
            "ResetQueuedResource": (self.reset_queued_resource, "ResetQueuedResourceRequest", None),
            "ListAcceleratorTypes": (
                self.accelerator_types,
                "ListAcceleratorTypesRequest",
                "ListAcceleratorTypesResponse",
            ),
            "ListRuntimeVersions": (
                self.runtime_versions,
                "ListRuntimeVersionsRequest",
                "ListRuntimeVersionsResponse",
            ),
        }
        alpha_methods = {"ListNodes", "GetNode", "UpdateNode", "GetGuestAttributes"}
        alpha = {name: spec for name, spec in v2.items() if name in alpha_methods}
        operations = {
            "GetOperation": grpc.unary_unary_rpc_method_handler(
                self._guarded("GetOperation", self.operations.get),
                request_deserializer=operations_pb2.GetOperationRequest.FromString,
                response_serializer=operations_pb2.Operation.SerializeToString,
            )
        }
        return [
            self._service("google.cloud.tpu.v2.Tpu", tpu_v2, v2),
            self._service("google.cloud.tpu.v2alpha1.Tpu", tpu_v2alpha1, alpha),
            grpc.method_handlers_generic_handler("google.longrunning.Operations", operations),
        ]

    def _service(self, service: str, types: ModuleType, methods: dict) -> grpc.GenericRpcHandler:
        handlers = {}
        for method, (impl, request_type, response_type) in methods.items():
            request_cls = getattr(types, request_type)

            def call(request, context, impl=impl):
                return impl(types, request, context)

            handlers[method] = grpc.unary_unary_rpc_method_handler(
                self._guarded(method, call),
                request_deserializer=request_cls.deserialize,
                # Long-running calls answer a plain protobuf Operation.
                response_serializer=getattr(types, response_type).serialize
                if response_type
                else operations_pb2.Operation.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(service, handlers)

    def _guarded(self, method: str, impl: Callable) -> Callable:
        def handle(request, context):
            with self._requests_lock:  # handlers run on many threads
                self.requests[method] += 1
            self._slow_down(request)
            fault = self._take_fault(method)
            if fault:
                context.abort(
                    grpc.StatusCode[fault], f"failure injected by the emulator ({method})"
                )
            try:
                return impl(request, context)
            except Abort as abort:
                context.abort(abort.code, abort.message)

        return handle

    def _slow_down(self, request) -> None:
        """Hold the answer when a test made the request's project slow."""
        slow = self.store.read().get("slow")
        if not slow:
            return
        about = getattr(request, "parent", "") or getattr(request, "name", "")
        match = _PROJECT.match(about)
        if match and match[1] in slow:
            time.sleep(float(slow[match[1]]))

    def _take_fault(self, method: str) -> str | None:
        def matches(fault):
            return fault["method"] in (None, method)

        if not any(matches(f) for f in self.store.read()["faults"]):
            return None  # the common case costs no write
        with self.store.transaction() as data:
            for fault in data["faults"]:
                if matches(fault):
                    fault["remaining"] -= 1
                    if fault["remaining"] <= 0:
                        data["faults"].remove(fault)
                    return fault["code"]
        return None

    @staticmethod
    def _find(state: State, name: str) -> dict[str, Any]:
        if not _NODE.match(name):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Malformed node name '{name}'")
        record = state["nodes"].get(name)
        if record is None:
            raise _not_found(name)
        return record

    # -- reads ----------------------------------------------------------------------

    def list_nodes(self, types, request, context):
        project, zone = _parent(request.parent)
        state = self.store.read()
        prefix = f"projects/{project}/locations/"
        names = sorted(
            name
            for name in state["nodes"]
            if name.startswith(prefix) and (zone == "-" or split_node_name(name)[1] == zone)
        )
        chunk, token = _page(names, request.page_size, request.page_token)
        nodes = [render_node(types, name, state["nodes"][name]) for name in chunk]
        return types.ListNodesResponse(nodes=nodes, next_page_token=token)

    def get_node(self, types, request, context):
        state = self.store.read()
        record = self._find(state, request.name)
        node = render_node(types, request.name, record)
        if "metadata_after_get" in record:
            # A test asked for a change by "someone else" right after this read.
            with self.store.transaction() as data:
                apply_metadata_after_get(self._find(data, request.name))
        return node

    def guest_attributes(self, types, request, context):
        """Per-worker guest attributes, in worker order (or the order asked for)."""
        record = self._find(self.store.read(), request.name)
        workers = record["workers"]
        try:
            wanted = [int(w) for w in request.worker_ids] or list(range(len(workers)))
        except ValueError:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_ids must be numbers") from None
        if any(not 0 <= w < len(workers) for w in wanted):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker_ids out of range: {wanted}")
        namespace, _, key = request.query_path.strip("/").partition("/")
        answers = []
        for index in wanted:
            items = [
                types.GuestAttributesEntry(namespace="hostkeys", key=key_type, value=value)
                for key_type, value in sorted(workers[index]["host_keys"].items())
                if namespace in ("", "hostkeys") and key in ("", key_type)
            ]
            answers.append(
                types.GuestAttributes(
                    query_path=request.query_path,
                    query_value=types.GuestAttributesValue(items=items),
                )
            )
        return types.GetGuestAttributesResponse(guest_attributes=answers)

    def accelerator_types(self, types, request, context):
        _parent(request.parent)
        names = sorted(f"{request.parent}/acceleratorTypes/{t}" for t in ACCELERATOR_TYPES)
        chunk, token = _page(names, request.page_size, request.page_token)
        items = [types.AcceleratorType(name=n, type_=n.rsplit("/", 1)[-1]) for n in chunk]
        return types.ListAcceleratorTypesResponse(accelerator_types=items, next_page_token=token)

    def runtime_versions(self, types, request, context):
        _parent(request.parent)
        names = sorted(f"{request.parent}/runtimeVersions/{v}" for v in RUNTIME_VERSIONS)
        chunk, token = _page(names, request.page_size, request.page_token)
        items = [types.RuntimeVersion(name=n, version=n.rsplit("/", 1)[-1]) for n in chunk]
        return types.ListRuntimeVersionsResponse(runtime_versions=items, next_page_token=token)

    # -- long-running changes -------------------------------------------------------

    def _finish(self, types, name: str, verb: str, *, deleted: bool = False):
        project, zone, _ = split_node_name(name)
        result = None if deleted else render_node(types, name, self.store.read()["nodes"][name])
        return self.operations.start(types, project, zone, name, verb, result)

    def create_node(self, types, request, context):
        project, zone = _parent(request.parent)
        if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", request.node_id or ""):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Invalid node_id '{request.node_id}'")
        node = request.node
        if not node.accelerator_type and not node.accelerator_config.topology:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "accelerator_type is required")
        accelerator_type = node.accelerator_type or "v4-8"
        try:
            with self.store.transaction() as data:
                if not queued.has_room(data, zone, accelerator_type):
                    message = queued.stockout_message(data, zone)
                    stockout = True
                else:
                    stockout = False
                    # Checked before the node is made: a refused disk makes nothing.
                    disks = _checked_disks(
                        data, f"{request.parent}/nodes/{request.node_id}", node.data_disks
                    )
                    name = self.controls.add_node(
                        project,
                        zone,
                        request.node_id,
                        accelerator_type=accelerator_type,
                        runtime_version=node.runtime_version or "tpu-ubuntu2204-base",
                        labels=dict(node.labels),
                        metadata=dict(node.metadata),
                        preemptible=node.scheduling_config.preemptible,
                        spot=node.scheduling_config.spot,
                    )
                    data["nodes"][name]["data_disks"] = disks
        except ControlError as exc:
            code = grpc.StatusCode.ALREADY_EXISTS if "exists" in str(exc) else None
            raise Abort(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if stockout:  # raised after the transaction, so the stockout's counter is kept
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return self._finish(types, name, "create")

    def delete_node(self, types, request, context):
        with self.store.transaction() as data:
            self._find(data, request.name)
            hostpool.drop_node(data, request.name)
        return self._finish(types, request.name, "delete", deleted=True)

    def stop_node(self, types, request, context):
        with self.store.transaction() as data:
            record = self._find(data, request.name)
            record.update(state="STOPPED", health="HEALTH_UNSPECIFIED")
            for worker in record["workers"]:
                worker["external_ip"] = ""  # ephemeral addresses go with the VM
        return self._finish(types, request.name, "stop")

    def start_node(self, types, request, context):
        with self.store.transaction() as data:
            record = self._find(data, request.name)
            if record["state"] != "READY":
                record.update(state="READY", health="HEALTHY")
                for worker in record["workers"]:
                    worker["external_ip"] = worker["external_ip"] or next_ip(data, "external_ip")
                    worker["host_keys"] = worker["host_keys"] or {"ssh-ed25519": new_host_key()}
        return self._finish(types, request.name, "start")

    def update_node(self, types, request, context):
        name = request.node.name
        version = types.__name__.rsplit("_", 1)[-1]
        paths = list(request.update_mask.paths)
        if not paths:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "update_mask is required")
        unknown = set(paths) - _UPDATABLE[version]
        if unknown:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"update_mask {sorted(unknown)} is not supported by {version} UpdateNode",
            )
        with self.store.transaction() as data:
            record = self._find(data, name)
            if record.get("deny_update"):
                raise Abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"Permission 'tpu.nodes.update' denied on resource '{name}' "
                    "(or it may not exist).",
                )
            if "metadata" in paths:
                record["metadata"] = dict(request.node.metadata)
            if "labels" in paths:
                record["labels"] = dict(request.node.labels)
            if "description" in paths:
                record["description"] = request.node.description
            if "data_disks" in paths:
                record["data_disks"] = _checked_disks(data, name, request.node.data_disks)
        return self._finish(types, name, "update")


def _checked_disks(data: State, node: str, disks) -> list[dict[str, str]]:
    """The node's new disk list from the request's ``AttachedDisk`` messages."""
    try:
        return emulated_disks.checked(
            data, node, [(d.source_disk, emulated_disks.mode_name(d.mode)) for d in disks]
        )
    except emulated_disks.DiskRefused as exc:
        raise Abort(exc.code, exc.message) from None

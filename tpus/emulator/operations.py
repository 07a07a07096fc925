"""Long-running operations, as ``google.longrunning.Operations`` serves them.

A mutating call changes the state at once and returns an Operation that reports
``done`` after ``delay`` seconds, with the resulting Node (or Empty) packed into
``response`` exactly as the real API does, so the unmodified client's
``operation.result()`` polls GetOperation and unpacks it. Operations live in the
server's memory only: they are short-lived handles, not lab state.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from types import ModuleType

import grpc
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2
from google.protobuf.message import Message


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


class OperationBook:
    """Operations started by this server, by name."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self._lock = threading.Lock()
        self._operations: dict[str, tuple[float, operations_pb2.Operation]] = {}

    def start(
        self, types: ModuleType, project: str, zone: str, target: str, verb: str, result=None
    ) -> operations_pb2.Operation:
        """Record a finished change; ``result`` is a proto-plus message or None (Empty)."""
        name = f"projects/{project}/locations/{zone}/operations/operation-{uuid.uuid4().hex}"
        metadata = types.OperationMetadata(
            create_time=datetime.now(UTC),
            end_time=datetime.now(UTC),
            target=target,
            verb=verb,
            api_version=types.__name__.rsplit("_", 1)[-1],
        )
        packed_result = _pack(empty_pb2.Empty() if result is None else type(result).pb(result))
        finished = operations_pb2.Operation(
            name=name,
            metadata=_pack(types.OperationMetadata.pb(metadata)),
            done=True,
            response=packed_result,
        )
        with self._lock:
            self._operations[name] = (time.monotonic() + self.delay, finished)
        return self._view(name)

    def _view(self, name: str) -> operations_pb2.Operation:
        with self._lock:
            done_at, finished = self._operations[name]
        if time.monotonic() >= done_at:
            return finished
        return operations_pb2.Operation(name=name, metadata=finished.metadata, done=False)

    def get(self, request: operations_pb2.GetOperationRequest, context: grpc.ServicerContext):
        with self._lock:
            known = request.name in self._operations
        if not known:
            context.abort(grpc.StatusCode.NOT_FOUND, f"Operation '{request.name}' was not found.")
        return self._view(request.name)

"""Long-running operations started now and looked at later, so that no task waits for
Google: a disk attach or detach (UpdateNode), a node's stop, start or deletion, , a
queued request's creation or cancellation is sent, and the operation's name handed back; a later
task asks how it goes, one GetOperation a look. ``CloudTPU`` mixes this in, so every
call still goes through its one choke point, ``_call``.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from google.api_core import exceptions as api_exceptions
from google.cloud import tpu_v2, tpu_v2alpha1
from google.longrunning import operations_pb2

from tpus.cloud import convert
from tpus.cloud.errors import CloudError, to_cloud_error
from tpus.cloud.records import NodeInfo


@dataclass(frozen=True)
class Started:
    """A change the API took: the operation to look at (again) later while it runs, or,
    once done, the node it left (None when it left none: a deletion)."""

    operation: str = ""
    node: NodeInfo | None = None

    @property
    def done(self) -> bool:
        return not self.operation


def gone_is_done(call) -> Started:
    """Send a deletion (``call``); one of something already gone is success."""
    try:
        return call()
    except CloudError as exc:
        if exc.code != "NOT_FOUND":
            raise
        return Started()


# What a finished operation carries, by the type its response is packed as.
_RESULTS = {
    "google.cloud.tpu.v2.Node": tpu_v2.Node,
    "google.cloud.tpu.v2alpha1.Node": tpu_v2alpha1.Node,
}


class OperationLooks:
    """Calls that do not wait, and the look at how they go."""

    def begin_attach_disk(
        self, project: str, zone: str, node: str, source_disk: str, mode: str = "READ_ONLY"
    ) -> Started:
        """``attach_disk`` without the wait (the same refusals)."""
        current, disks = self._disks_attaching(project, zone, node, source_disk, mode)
        return self._begin_disks(current, disks)

    def begin_detach_disk(self, project: str, zone: str, node: str, source_disk: str) -> Started:
        """``detach_disk`` without the wait. Not attached is success."""
        current, disks = self._disks_detaching(project, zone, node, source_disk)
        return self._begin_disks(current, disks)

    def _begin_disks(self, current, disks) -> Started:
        if disks is None:
            return Started(node=convert.node_info(current))
        return self._started(self._update_disks(current, disks, wait=False), "UpdateNode")

    def begin_create_node(self, project: str, wanted) -> Started:
        """``create_node`` without the wait (look with ``method="CreateNode"``)."""
        return self._started(self._create_node(project, wanted, wait=False), "CreateNode")

    def begin_create_queued_resource(self, project: str, request_id: str, wanted) -> Started:
        """``create_queued_resource`` without the wait (look with
        ``method="CreateQueuedResource"``)."""
        return self._started(
            self._create_queued_resource(project, request_id, wanted, wait=False),
            "CreateQueuedResource",
        )

    def begin_stop_node(self, project: str, zone: str, name: str) -> Started:
        """``stop_node`` without the wait."""
        return self._begin_node("StopNode", "stop_node", project, zone, name)

    def begin_start_node(self, project: str, zone: str, name: str) -> Started:
        """``start_node`` without the wait."""
        return self._begin_node("StartNode", "start_node", project, zone, name)

    def begin_delete_node(self, project: str, zone: str, name: str) -> Started:
        """``delete_node`` without the wait."""
        return self._begin_node("DeleteNode", "delete_node", project, zone, name)

    def begin_delete_queued_resource(
        self, project: str, zone: str, request_id: str, *, with_node: bool = False
    ) -> Started:
        """``delete_queued_resource`` without the wait."""
        name = f"projects/{project}/locations/{zone}/queuedResources/{request_id}"

        def send():
            v2, _ = self._tpu()
            return v2.delete_queued_resource(
                request={"name": name, "force": with_node},
                timeout=self.config.timeout,
                retry=None,
            )

        return self._started(
            self._call("DeleteQueuedResource", send, read=False), "DeleteQueuedResource"
        )

    def _begin_node(self, method: str, call: str, project: str, zone: str, name: str):
        operation = self._node_operation(method, call, project, zone, name, wait=False)
        return self._started(operation, method)

    def _started(self, operation, method: str) -> Started:
        raw = operation.operation
        if raw.done:
            return Started(node=self._finished(raw, method))
        return Started(operation=raw.name)

    def look_at_operation(self, name: str, *, waited: float, method: str) -> Started:
        """One look at an operation this client started ``waited`` seconds ago (a call
        to ``method``): still running, or done with the node it left. Raises CloudError
        when it failed, or when it still runs after ``operation_timeout`` (as the
        waiting calls do). Asked through the API version that started it, as the
        waiting calls poll: v2alpha1 for a disk's UpdateNode, v2 for the rest."""
        request = operations_pb2.GetOperationRequest(name=name)

        def send():
            client = self._tpu()[1 if method == "UpdateNode" else 0]
            return client.get_operation(request=request, timeout=self.config.timeout, retry=None)

        raw = self._call("GetOperation", send, read=True)
        if raw.done:
            return Started(node=self._finished(raw, method))
        if waited >= self.config.operation_timeout:
            raise to_cloud_error(method, concurrent.futures.TimeoutError())
        return Started(operation=name)

    def next_look_in(self, waited: float) -> float:
        """Seconds until the next look at an operation started ``waited`` seconds ago:
        soon at first, then further apart, as the waiting calls poll."""
        config = self.config
        return min(
            config.poll_maximum,
            max(config.poll_initial, waited * (config.poll_multiplier - 1)),
        )

    @staticmethod
    def _finished(raw: operations_pb2.Operation, method: str) -> NodeInfo | None:
        if raw.HasField("error"):
            failure = api_exceptions.from_grpc_status(raw.error.code, raw.error.message)
            raise to_cloud_error(method, failure)
        result = _RESULTS.get(raw.response.type_url.rsplit("/", 1)[-1])
        return None if result is None else convert.node_info(result.deserialize(raw.response.value))

"""Long-running operations started now and looked at later, so that no task waits for
Google: a disk attach or detach sends its UpdateNode and hands back the operation's
name; a later task asks how it goes, one GetOperation a look. ``CloudTPU`` mixes this
in, so every call still goes through its one choke point, ``_call``.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from google.api_core import exceptions as api_exceptions
from google.cloud import tpu_v2alpha1
from google.longrunning import operations_pb2

from tpus.cloud import convert
from tpus.cloud.errors import to_cloud_error
from tpus.cloud.records import NodeInfo


@dataclass(frozen=True)
class Started:
    """A change the API took: the operation to look at later, or the node when it is
    done already (nothing to change, or finished at once)."""

    operation: str = ""
    node: NodeInfo | None = None


class OperationLooks:
    """Disk changes that do not wait, and the look at how they go."""

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
        raw = self._update_disks(current, disks, wait=False).operation
        if raw.done:
            return Started(node=self._finished(raw, "UpdateNode"))
        return Started(operation=raw.name)

    def look_at_operation(self, name: str, *, waited: float, method: str = "UpdateNode"):
        """One look at an operation this client started, ``waited`` seconds ago: the
        node it left, or None while it runs. Raises CloudError when it failed, or when
        it still runs after ``operation_timeout`` (as the waiting calls do)."""
        request = operations_pb2.GetOperationRequest(name=name)

        def send():
            _, alpha = self._tpu()
            return alpha.get_operation(request=request, timeout=self.config.timeout, retry=None)

        raw = self._call("GetOperation", send, read=True)
        if raw.done:
            return self._finished(raw, method)
        if waited >= self.config.operation_timeout:
            raise to_cloud_error(method, concurrent.futures.TimeoutError())
        return None

    def next_look_in(self, waited: float) -> float:
        """Seconds until the next look at an operation started ``waited`` seconds ago:
        soon at first, then further apart, as the waiting calls poll."""
        config = self.config
        return min(
            config.poll_maximum,
            max(config.poll_initial, waited * (config.poll_multiplier - 1)),
        )

    @staticmethod
    def _finished(raw: operations_pb2.Operation, method: str) -> NodeInfo:
        if raw.HasField("error"):
            failure = api_exceptions.from_grpc_status(raw.error.code, raw.error.message)
            raise to_cloud_error(method, failure)
        return convert.node_info(tpu_v2alpha1.Node.deserialize(raw.response.value))

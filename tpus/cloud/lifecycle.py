"""Making, stopping, starting and deleting TPU VMs, directly (``CreateNode``) or as a
queued resource that waits for capacity (``CreateQueuedResource``), and what a zone
offers (accelerator types, runtime versions). ``CloudTPU`` mixes this in, so every call
still goes through its one choke point, ``_call``.

A created node carries its metadata from the start: the portal puts the lab's
``ssh-keys`` line there, so the VM is connected without a Connect step.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from google.cloud import tpu_v2

from tpus.cloud import convert
from tpus.cloud.records import NodeInfo

PROVISIONING = ("on-demand", "spot", "preemptible")


@dataclass(frozen=True)
class NodeRequest:
    """A TPU VM the portal asks for."""

    name: str  # the node id, e.g. "tpu5"
    zone: str
    accelerator_type: str  # v4-32
    runtime_version: str  # tpu-ubuntu2204-base
    provisioning: str = "on-demand"  # one of PROVISIONING
    metadata: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    data_disks: Sequence[tuple[str, str]] = ()  # (source disk path, READ_ONLY|READ_WRITE)
    # A queued request's window: not provisioned before, failed when still waiting after.
    valid_after: dt.datetime | None = None
    valid_until: dt.datetime | None = None


@dataclass(frozen=True)
class QueuedResourceInfo:
    """A queued request for a TPU VM, as the API reports it."""

    name: str  # the request's id
    zone: str
    resource_name: str  # projects/<p>/locations/<zone>/queuedResources/<id>
    node_id: str
    state: str  # WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED, SUSPENDED, ...
    initiated_by: str  # USER or SERVICE: who moved it to this state
    accelerator_type: str
    runtime_version: str
    provisioning: str
    error_code: str = ""  # gRPC status name when FAILED: RESOURCE_EXHAUSTED, ...
    error_message: str = ""
    created_at: dt.datetime | None = None
    valid_until: dt.datetime | None = None


class NodeLifecycle:
    """The lifecycle calls of ``CloudTPU``."""

    # -- what a zone offers ---------------------------------------------------------

    def accelerator_types(self, project: str, zone: str) -> list[str]:
        parent = f"projects/{project}/locations/{zone}"

        def send():
            v2, _ = self._tpu()
            pager = v2.list_accelerator_types(
                parent=parent, timeout=self.config.timeout, retry=None
            )
            return sorted({t.type_ for t in pager})

        return self._call("ListAcceleratorTypes", send, read=True)

    def runtime_versions(self, project: str, zone: str) -> list[str]:
        parent = f"projects/{project}/locations/{zone}"

        def send():
            v2, _ = self._tpu()
            pager = v2.list_runtime_versions(parent=parent, timeout=self.config.timeout, retry=None)
            return sorted({v.version for v in pager})

        return self._call("ListRuntimeVersions", send, read=True)

    # -- nodes ----------------------------------------------------------------------

    def create_node(self, project: str, wanted: NodeRequest) -> NodeInfo:
        """``CreateNode`` and wait until it is made. A stockout is a retryable
        ``RESOURCE_EXHAUSTED`` CloudError; nothing is made then."""
        return convert.node_info(self._create_node(project, wanted, wait=True))

    def _create_node(self, project: str, wanted: NodeRequest, *, wait: bool):
        request = tpu_v2.CreateNodeRequest(
            parent=f"projects/{project}/locations/{wanted.zone}",
            node_id=wanted.name,
            node=_node(wanted),
        )

        def send():
            v2, _ = self._tpu()
            operation = v2.create_node(request=request, timeout=self.config.timeout, retry=None)
            return self._wait(operation) if wait else operation

        return self._call("CreateNode", send, read=False)

    def delete_node(self, project: str, zone: str, name: str) -> None:
        self._node_operation("DeleteNode", "delete_node", project, zone, name)

    def stop_node(self, project: str, zone: str, name: str) -> NodeInfo:
        return convert.node_info(self._node_operation("StopNode", "stop_node", project, zone, name))

    def start_node(self, project: str, zone: str, name: str) -> NodeInfo:
        return convert.node_info(
            self._node_operation("StartNode", "start_node", project, zone, name)
        )

    def _node_operation(
        self, method: str, call: str, project: str, zone: str, name: str, *, wait: bool = True
    ):
        resource = f"projects/{project}/locations/{zone}/nodes/{name}"

        def send():
            v2, _ = self._tpu()
            operation = getattr(v2, call)(
                request={"name": resource}, timeout=self.config.timeout, retry=None
            )
            return self._wait(operation) if wait else operation

        return self._call(method, send, read=False)

    # -- queued resources -----------------------------------------------------------

    def create_queued_resource(
        self, project: str, request_id: str, wanted: NodeRequest
    ) -> QueuedResourceInfo:
        """Ask for a TPU VM that waits for capacity. Returns the request as accepted."""
        return queued_info(self._create_queued_resource(project, request_id, wanted, wait=True))

    def _create_queued_resource(
        self, project: str, request_id: str, wanted: NodeRequest, *, wait: bool
    ):
        parent = f"projects/{project}/locations/{wanted.zone}"
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
            parent=parent, node_id=wanted.name, node=_node(wanted)
        )
        resource = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
        if wanted.provisioning == "spot":
            resource.spot = tpu_v2.QueuedResource.Spot()
        policy = {}
        if wanted.valid_after:
            policy["valid_after_time"] = wanted.valid_after
        if wanted.valid_until:
            policy["valid_until_time"] = wanted.valid_until
        if policy:
            resource.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(**policy)
        request = tpu_v2.CreateQueuedResourceRequest(
            parent=parent, queued_resource_id=request_id, queued_resource=resource
        )

        def send():
            v2, _ = self._tpu()
            operation = v2.create_queued_resource(
                request=request, timeout=self.config.timeout, retry=None
            )
            return self._wait(operation) if wait else operation

        return self._call("CreateQueuedResource", send, read=False)

    def get_queued_resource(self, project: str, zone: str, request_id: str) -> QueuedResourceInfo:
        name = f"projects/{project}/locations/{zone}/queuedResources/{request_id}"

        def send():
            v2, _ = self._tpu()
            return v2.get_queued_resource(name=name, timeout=self.config.timeout, retry=None)

        return queued_info(self._call("GetQueuedResource", send, read=True))

    def list_queued_resources(self, project: str, zone: str) -> list[QueuedResourceInfo]:
        """Every queued request in one (project, zone)."""
        parent = f"projects/{project}/locations/{zone}"

        def send():
            v2, _ = self._tpu()
            pager = v2.list_queued_resources(
                request={"parent": parent, "page_size": self.config.page_size},
                timeout=self.config.timeout,
                retry=None,
            )
            return [queued_info(r) for r in pager]

        return self._call("ListQueuedResources", send, read=True)

    def delete_queued_resource(
        self, project: str, zone: str, request_id: str, *, with_node: bool = False
    ) -> None:
        """Cancel a request. ``with_node`` deletes the node it made too (``force``)."""
        name = f"projects/{project}/locations/{zone}/queuedResources/{request_id}"

        def send():
            v2, _ = self._tpu()
            operation = v2.delete_queued_resource(
                request={"name": name, "force": with_node},
                timeout=self.config.timeout,
                retry=None,
            )
            return self._wait(operation)

        self._call("DeleteQueuedResource", send, read=False)

    def reset_queued_resource(self, project: str, zone: str, request_id: str) -> QueuedResourceInfo:
        """Put a suspended (preempted) or failed request back in line for capacity."""
        name = f"projects/{project}/locations/{zone}/queuedResources/{request_id}"

        def send():
            v2, _ = self._tpu()
            operation = v2.reset_queued_resource(name=name, timeout=self.config.timeout, retry=None)
            return self._wait(operation)

        return queued_info(self._call("ResetQueuedResource", send, read=False))


def _node(wanted: NodeRequest) -> tpu_v2.Node:
    if wanted.provisioning not in PROVISIONING:
        raise ValueError(f"provisioning is one of {PROVISIONING}, not {wanted.provisioning!r}")
    return tpu_v2.Node(
        accelerator_type=wanted.accelerator_type,
        runtime_version=wanted.runtime_version,
        metadata=dict(wanted.metadata),
        labels=dict(wanted.labels),
        scheduling_config=tpu_v2.SchedulingConfig(
            spot=wanted.provisioning == "spot", preemptible=wanted.provisioning == "preemptible"
        ),
        data_disks=[
            tpu_v2.AttachedDisk(source_disk=disk, mode=mode) for disk, mode in wanted.data_disks
        ],
    )


def _when(stamp) -> dt.datetime | None:
    if not stamp:
        return None
    return dt.datetime(*stamp.timetuple()[:6], stamp.microsecond, tzinfo=dt.UTC)


def queued_info(resource) -> QueuedResourceInfo:
    """The plain record of a ``QueuedResource`` message."""
    parts = resource.name.split("/")
    [spec] = resource.tpu.node_spec or [tpu_v2.QueuedResource.Tpu.NodeSpec()]
    node = spec.node
    state = resource.state
    error = state.failed_data.error if "failed_data" in state else None
    if "spot" in resource or node.scheduling_config.spot:
        provisioning = "spot"
    elif node.scheduling_config.preemptible:
        provisioning = "preemptible"
    else:
        provisioning = "on-demand"
    policy = resource.queueing_policy
    return QueuedResourceInfo(
        name=parts[-1],
        zone=parts[3] if len(parts) == 6 else "",
        resource_name=resource.name,
        node_id=spec.node_id,
        state=state.state.name,
        initiated_by=state.state_initiator.name.replace("STATE_INITIATOR_UNSPECIFIED", ""),
        accelerator_type=node.accelerator_type,
        runtime_version=node.runtime_version,
        provisioning=provisioning,
        error_code=_status_name(error.code) if error else "",
        error_message=error.message if error else "",
        created_at=_when(resource.create_time),
        valid_until=_when(policy.valid_until_time) if "valid_until_time" in policy else None,
    )


def _status_name(code: int) -> str:
    import grpc

    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)

"""The portal's client for the Cloud TPU API (v2, and v2alpha1 for disk attachment).

Every RPC goes through ``CloudTPU._call``: it counts the call, applies the timeout,
retries a read a few times when the failure is retryable, and turns every library
error into ``CloudError``. Tests that do not need the API patch that one method.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import google.auth
import google.auth.exceptions
import grpc
from google.api_core.client_options import ClientOptions
from google.api_core.future import polling
from google.cloud import tpu_v2, tpu_v2alpha1
from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport
from google.cloud.tpu_v2alpha1.services.tpu.transports import (
    TpuGrpcTransport as AlphaTpuGrpcTransport,
)
from google.oauth2 import service_account

from tpus.cloud import convert, sshkeys
from tpus.cloud.errors import CloudError, to_cloud_error
from tpus.cloud.lifecycle import NodeLifecycle
from tpus.cloud.operations import OperationLooks
from tpus.cloud.records import GuestHostKeys, MetadataChange, NodeInfo
from tpus.cloud.sshkeys import KeyLine

logger = logging.getLogger(__name__)
T = TypeVar("T")
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
DISK_MODES = ("READ_ONLY", "READ_WRITE")


@dataclass(frozen=True)
class CloudConfig:
    """How to reach the API. ``endpoint`` empty means Google's own; ``insecure`` means
    a plaintext channel without credentials to ``endpoint`` (the local emulator)."""

    endpoint: str = ""
    insecure: bool = False
    credentials_file: str = ""  # empty: application default credentials
    timeout: float = 30.0  # seconds, every RPC
    operation_timeout: float = 600.0  # seconds, waiting for a long-running operation
    page_size: int = 500
    retry_attempts: int = 3  # reads only; writes are tried once
    retry_initial: float = 0.2
    retry_maximum: float = 2.0
    poll_initial: float = 1.0
    poll_multiplier: float = 1.5
    poll_maximum: float = 10.0
    # Read-modify-write of node metadata: how often to start over when the metadata
    # changed under us (or another update was running), and the pause between tries.
    metadata_attempts: int = 5
    metadata_retry_pause: float = 1.0


class CloudTPU(NodeLifecycle, OperationLooks):
    """Reads a lab's TPU VMs, attaches their disks (waiting, or started here and looked
    at later: ``OperationLooks``), and makes, stops, starts and deletes them
    (``NodeLifecycle``). Thread-safe; share one."""

    def __init__(self, config: CloudConfig):
        self.config = config
        self._lock = threading.Lock()
        self._clients: tuple[tpu_v2.TpuClient, tpu_v2alpha1.TpuClient] | None = None
        self._calls: Counter[str] = Counter()

    # -- the choke point ------------------------------------------------------------

    @property
    def calls(self) -> Counter[str]:
        """RPCs sent so far, by API method name (``ListNodes``), retries included.
        Polls of a long-running operation are the client library's and not counted."""
        with self._lock:
            return Counter(self._calls)

    def reset_calls(self) -> None:
        with self._lock:
            self._calls.clear()

    def _call(self, method: str, send: Callable[[], T], *, read: bool) -> T:
        attempts = max(1, self.config.retry_attempts) if read else 1
        delay = self.config.retry_initial
        for attempt in itertools.count(1):
            with self._lock:
                self._calls[method] += 1
            try:
                return send()
            except Exception as exc:
                error = to_cloud_error(method, exc)
                if error is None:
                    raise
                if not error.retryable or attempt >= attempts:
                    raise error from exc
            # Full jitter keeps many workers that failed together from retrying together.
            pause = random.uniform(0, delay)  # noqa: S311 - jitter, not a secret
            logger.info("%s: %s; retry %d in %.2fs", method, error.code, attempt, pause)
            time.sleep(pause)
            delay = min(delay * 2, self.config.retry_maximum)
        raise AssertionError("unreachable")

    def _tpu(self) -> tuple[tpu_v2.TpuClient, tpu_v2alpha1.TpuClient]:
        with self._lock:
            if self._clients is None:
                self._clients = self._build()
            return self._clients

    def _build(self) -> tuple[tpu_v2.TpuClient, tpu_v2alpha1.TpuClient]:
        config = self.config
        if config.insecure:
            # Proxy variables would route even 127.0.0.1 through a proxy.
            channel = grpc.insecure_channel(
                config.endpoint, options=[("grpc.enable_http_proxy", 0)]
            )
            return (
                tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel)),
                tpu_v2alpha1.TpuClient(transport=AlphaTpuGrpcTransport(channel=channel)),
            )
        try:
            if config.credentials_file:
                credentials = service_account.Credentials.from_service_account_file(
                    config.credentials_file, scopes=SCOPES
                )
            else:
                credentials, _ = google.auth.default(scopes=SCOPES)
        except (OSError, ValueError, google.auth.exceptions.GoogleAuthError) as exc:
            raise CloudError(
                f"Cloud TPU API credentials could not be loaded: {exc}",
                code="UNAUTHENTICATED",
                retryable=False,
            ) from exc
        options = ClientOptions(api_endpoint=config.endpoint) if config.endpoint else None
        return (
            tpu_v2.TpuClient(credentials=credentials, client_options=options, transport="grpc"),
            tpu_v2alpha1.TpuClient(
                credentials=credentials, client_options=options, transport="grpc"
            ),
        )

    def _wait(self, operation):
        """Block until a long-running operation is done; its result, or its error raised."""
        config = self.config
        poll = polling.DEFAULT_POLLING.with_delay(
            initial=config.poll_initial,
            maximum=config.poll_maximum,
            multiplier=config.poll_multiplier,
        ).with_timeout(config.operation_timeout)
        return operation.result(timeout=config.operation_timeout, polling=poll)

    # -- reads ----------------------------------------------------------------------

    def list_nodes(
        self, project: str, zone: str, *, page_size: int | None = None
    ) -> list[NodeInfo]:
        """Every node in one (project, zone): one ListNodes call per page."""
        parent = f"projects/{project}/locations/{zone}"
        size = page_size or self.config.page_size
        nodes: list[NodeInfo] = []
        token = ""
        while True:
            page = self._call(
                "ListNodes", lambda t=token: self._list_page(parent, size, t), read=True
            )
            nodes.extend(convert.node_info(node) for node in page.nodes)
            token = page.next_page_token
            if not token:
                return nodes

    def _list_page(self, parent: str, size: int, token: str):
        v2, _ = self._tpu()
        request = tpu_v2.ListNodesRequest(parent=parent, page_size=size, page_token=token)
        pager = v2.list_nodes(request=request, timeout=self.config.timeout, retry=None)
        # Only the first page: later pages are fetched by list_nodes, through _call.
        return next(iter(pager.pages))

    def get_node(self, project: str, zone: str, name: str) -> NodeInfo:
        return convert.node_info(self._get(project, zone, name, alpha=False))

    def _get(self, project: str, zone: str, name: str, *, alpha: bool):
        resource = f"projects/{project}/locations/{zone}/nodes/{name}"

        def send():
            client = self._tpu()[1 if alpha else 0]
            return client.get_node(name=resource, timeout=self.config.timeout, retry=None)

        return self._call("GetNode", send, read=True)

    def guest_host_keys(
        self, project: str, zone: str, name: str, workers: Sequence[int] | None = None
    ) -> GuestHostKeys:
        """The SSH host keys each worker published (all workers, or those listed)."""
        wanted = list(workers or ())
        request = tpu_v2.GetGuestAttributesRequest(
            name=f"projects/{project}/locations/{zone}/nodes/{name}",
            query_path="hostkeys/",
            worker_ids=[str(w) for w in wanted],
        )

        def send():
            v2, _ = self._tpu()
            return v2.get_guest_attributes(request=request, timeout=self.config.timeout, retry=None)

        try:
            response = self._call("GetGuestAttributes", send, read=True)
        except CloudError as error:
            # Compute Engine answers this way until the guest agent has published keys.
            if error.code == "NOT_FOUND" and "Guest Attribute" in error.message:
                return GuestHostKeys(workers={})
            raise
        return convert.host_keys(response, wanted)

    # -- metadata -------------------------------------------------------------------

    def node_metadata(self, project: str, zone: str, node: str) -> dict[str, str]:
        """The node's metadata map (``ssh-keys``, ``enable-oslogin``, ...)."""
        return dict(self._get(project, zone, node, alpha=False).metadata)

    def add_ssh_key(self, project: str, zone: str, node: str, key: KeyLine) -> MetadataChange:
        """Add ``key``'s line to the node's ``ssh-keys`` and wait until it is in force.
        Already there (same account and key, any comment) is success."""
        return self._edit_ssh_keys(project, zone, node, key, add=True)

    def remove_ssh_key(self, project: str, zone: str, node: str, key: KeyLine) -> MetadataChange:
        """Remove ``key``'s line from the node's ``ssh-keys``. Not there is success."""
        return self._edit_ssh_keys(project, zone, node, key, add=False)

    def _edit_ssh_keys(
        self, project: str, zone: str, node: str, key: KeyLine, *, add: bool
    ) -> MetadataChange:
        """Read-modify-write of the whole metadata map, changing one ``ssh-keys`` line.

        UpdateNode with mask ``metadata`` replaces the whole map, and v2's Node carries
        no etag or fingerprint to make the write conditional. So: read, compute the new
        map, read again right before writing and start over when anything changed since
        the first read; after the operation, read once more and start over when our
        line is not as we left it. What remains is the time between the second read
        and the server applying the write (one round trip): a change someone else
        makes inside it is lost, and nothing the API offers can close that window.
        """
        config = self.config
        attempts = max(1, config.metadata_attempts)
        last_reason = ""
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                ceiling = config.metadata_retry_pause
                pause = random.uniform(ceiling / 2, ceiling)  # noqa: S311 - jitter
                logger.info("%s ssh-keys: %s; try %d in %.2fs", node, last_reason, attempt, pause)
                time.sleep(pause)
            before = self.node_metadata(project, zone, node)
            value = before.get(sshkeys.SSH_KEYS, "")
            new_value = sshkeys.with_line(value, key) if add else sshkeys.without_line(value, key)
            if new_value == value:
                return MetadataChange(changed=False, attempts=attempt, metadata=before)
            wanted = dict(before)
            if new_value:
                wanted[sshkeys.SSH_KEYS] = new_value
            else:
                del wanted[sshkeys.SSH_KEYS]
            if self.node_metadata(project, zone, node) != before:
                last_reason = "the metadata changed while it was being edited"
                continue
            try:
                self._update_metadata(project, zone, node, wanted)
            except CloudError as error:
                # Another update of the node is running (the API answers ABORTED).
                if error.code != "ABORTED":
                    raise
                last_reason = "another update of the node was running"
                continue
            after = self.node_metadata(project, zone, node)
            if sshkeys.has_line(after.get(sshkeys.SSH_KEYS, ""), key) == add:
                return MetadataChange(changed=True, attempts=attempt, metadata=after)
            last_reason = "the metadata was changed again right after the update"
        raise CloudError(
            f"Could not change the ssh-keys metadata of {node} in {attempts} tries: "
            f"{last_reason}. Try again in a minute.",
            code="ABORTED",
            retryable=True,
            method="UpdateNode",
        )

    def _update_metadata(self, project: str, zone: str, node: str, metadata: dict) -> None:
        request = tpu_v2.UpdateNodeRequest(
            node=tpu_v2.Node(
                name=f"projects/{project}/locations/{zone}/nodes/{node}", metadata=metadata
            ),
            update_mask={"paths": ["metadata"]},
        )

        def send():
            v2, _ = self._tpu()
            operation = v2.update_node(request=request, timeout=self.config.timeout, retry=None)
            return self._wait(operation)

        self._call("UpdateNode", send, read=False)

    # -- disks ----------------------------------------------------------------------

    def attach_disk(
        self, project: str, zone: str, node: str, source_disk: str, mode: str = "READ_ONLY"
    ) -> NodeInfo:
        """Attach a data disk and wait until it is attached. Already attached in this mode
        is success; a read-write disk in use by another VM is refused by the API
        (FAILED_PRECONDITION)."""
        current, disks = self._disks_attaching(project, zone, node, source_disk, mode)
        if disks is None:
            return convert.node_info(current)
        return self._update_disks(current, disks)

    def detach_disk(self, project: str, zone: str, node: str, source_disk: str) -> NodeInfo:
        """Detach a data disk and wait until it is gone. Not attached is success."""
        current, disks = self._disks_detaching(project, zone, node, source_disk)
        if disks is None:
            return convert.node_info(current)
        return self._update_disks(current, disks)

    def _disks_attaching(self, project: str, zone: str, node: str, source_disk: str, mode: str):
        """The node as it is, and its disk list with the disk attached (None: it is
        already attached in this mode)."""
        if mode not in DISK_MODES:
            raise ValueError(f"mode must be one of {DISK_MODES}, not {mode!r}")
        disk = _disk_path(project, zone, source_disk)
        current = self._get(project, zone, node, alpha=True)
        for attached in current.data_disks:
            if attached.source_disk == disk:
                if _mode(attached) == mode:
                    return current, None
                raise CloudError(
                    f"{disk} is already attached to {node} as {_mode(attached)}; "
                    f"detach it before attaching it as {mode}",
                    code="FAILED_PRECONDITION",
                    retryable=False,
                    method="UpdateNode",
                )
        return current, [
            *current.data_disks,
            tpu_v2alpha1.AttachedDisk(source_disk=disk, mode=mode),
        ]

    def _disks_detaching(self, project: str, zone: str, node: str, source_disk: str):
        """The node as it is, and its disk list without the disk (None: not attached)."""
        disk = _disk_path(project, zone, source_disk)
        current = self._get(project, zone, node, alpha=True)
        remaining = [d for d in current.data_disks if d.source_disk != disk]
        if len(remaining) == len(current.data_disks):
            return current, None
        return current, remaining

    def _update_disks(self, current, disks, *, wait: bool = True):
        # gcloud's attach-disk does exactly this: v2alpha1 UpdateNode, mask data_disks,
        # carrying the whole list (v2's UpdateNode does not accept that mask).
        request = tpu_v2alpha1.UpdateNodeRequest(
            node=tpu_v2alpha1.Node(name=current.name, data_disks=disks),
            update_mask={"paths": ["data_disks"]},
        )

        def send():
            _, alpha = self._tpu()
            operation = alpha.update_node(request=request, timeout=self.config.timeout, retry=None)
            return self._wait(operation) if wait else operation

        sent = self._call("UpdateNode", send, read=False)
        return convert.node_info(sent) if wait else sent


def _mode(disk) -> str:
    return "READ_ONLY" if getattr(disk.mode, "name", "") == "READ_ONLY" else "READ_WRITE"


def _disk_path(project: str, zone: str, disk: str) -> str:
    """Full disk path; a bare name means a disk in the node's project and zone."""
    return disk if disk.startswith("projects/") else f"projects/{project}/zones/{zone}/disks/{disk}"

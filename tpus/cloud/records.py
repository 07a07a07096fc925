"""What the Cloud TPU API says about a lab's TPU VMs, as plain frozen values.

Nothing outside ``tpus.cloud`` sees a protobuf: these records are all the rest of the
portal gets. Enum values are their API names (``READY``, ``UNHEALTHY_MAINTENANCE``,
``READ_ONLY``) so they map one-to-one onto the portal's own choices.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

# What gcloud accepts from guest attributes; anything else there is not a host key.
HOST_KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)


@dataclass(frozen=True)
class WorkerInfo:
    """One host of a TPU VM (``network_endpoints[index]``)."""

    index: int
    internal_ip: str
    external_ip: str | None  # None while the worker has no external address


@dataclass(frozen=True)
class DiskInfo:
    """A data disk attached to a TPU VM."""

    source_disk: str  # projects/<project>/zones/<zone>/disks/<name>
    mode: str  # READ_WRITE or READ_ONLY

    @property
    def name(self) -> str:
        return self.source_disk.rsplit("/", 1)[-1]

    @property
    def zone(self) -> str:
        parts = self.source_disk.split("/")
        return parts[3] if len(parts) > 3 and parts[2] == "zones" else ""


@dataclass(frozen=True)
class NodeInfo:
    """A TPU VM as the API reports it."""

    name: str  # the short node id, e.g. "tpu5"
    zone: str
    resource_name: str  # projects/<project>/locations/<zone>/nodes/<name>
    state: str  # Node.State name: READY, STOPPED, PREEMPTED, REPAIRING, ...
    health: str  # Node.Health name: HEALTHY, UNHEALTHY_MAINTENANCE, HEALTH_UNSPECIFIED, ...
    health_description: str
    accelerator_type: str  # v4-32
    topology: str  # 2x2x4, or "" when the API does not say
    runtime_version: str
    labels: Mapping[str, str] = field(default_factory=dict)
    workers: tuple[WorkerInfo, ...] = ()
    data_disks: tuple[DiskInfo, ...] = ()
    preemptible: bool = False
    spot: bool = False
    create_time: datetime | None = None

    @property
    def project(self) -> str:
        return self.resource_name.split("/")[1]


@dataclass(frozen=True)
class MetadataChange:
    """How an edit of a node's metadata ended: whether it wrote anything, after how
    many tries, and the metadata as read back afterwards."""

    changed: bool
    attempts: int
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GuestHostKeys:
    """SSH host keys each worker published under guest attributes ``hostkeys/``.

    ``workers[index]`` maps a key type to a known_hosts style ``"type base64"`` line.
    A worker that published nothing (yet) has an empty mapping.
    """

    workers: Mapping[int, Mapping[str, str]]

    def for_worker(self, index: int) -> Mapping[str, str]:
        return self.workers.get(index, {})


def host_key_line(key_type: str, value: str) -> str | None:
    """Normalise one guest attribute to ``"type base64"``, or None if it is no key.

    The guest agent publishes the base64 blob alone; other tools write the whole
    ``"type base64 [comment]"`` line. Both are accepted, the comment is dropped, and
    the blob must decode and carry the same type inside it, so a stray attribute
    never becomes a pinned key.
    """
    if key_type not in HOST_KEY_TYPES:
        return None
    words = value.split()
    if len(words) == 1:
        blob = words[0]
    elif len(words) >= 2 and words[0] == key_type:
        blob = words[1]
    else:
        return None
    try:
        raw = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        return None
    length = int.from_bytes(raw[:4], "big")
    if len(raw) < 4 + length or raw[4 : 4 + length] != key_type.encode():
        return None
    return f"{key_type} {blob}"

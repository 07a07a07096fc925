"""API messages → portal records. Works on v2 and v2alpha1 messages alike: the fields
the portal reads have the same names in both."""

from __future__ import annotations

import enum
from datetime import datetime

from tpus.cloud.records import DiskInfo, GuestHostKeys, NodeInfo, WorkerInfo, host_key_line


def _enum_name(value, unknown: str) -> str:
    # A value newer than this client's enum arrives as a bare int.
    if isinstance(value, enum.Enum):
        return value.name
    return unknown if not value else f"{unknown}_{int(value)}"


def node_info(node) -> NodeInfo:
    parts = node.name.split("/")  # projects/<p>/locations/<zone>/nodes/<id>
    zone = parts[3] if len(parts) == 6 else ""
    workers = tuple(
        WorkerInfo(
            index=i,
            internal_ip=endpoint.ip_address,
            external_ip=endpoint.access_config.external_ip or None,
        )
        for i, endpoint in enumerate(node.network_endpoints)
    )
    disks = tuple(
        DiskInfo(
            source_disk=disk.source_disk,
            # The API documents an unset mode as READ_WRITE.
            mode="READ_ONLY" if _enum_name(disk.mode, "") == "READ_ONLY" else "READ_WRITE",
        )
        for disk in node.data_disks
    )
    stamp = node.create_time  # a protobuf helper subclass of datetime, or None
    create_time = (
        datetime(*stamp.timetuple()[:6], stamp.microsecond, tzinfo=stamp.tzinfo) if stamp else None
    )
    return NodeInfo(
        name=parts[-1],
        zone=zone,
        resource_name=node.name,
        state=_enum_name(node.state, "STATE_UNSPECIFIED"),
        health=_enum_name(node.health, "HEALTH_UNSPECIFIED"),
        health_description=node.health_description,
        accelerator_type=node.accelerator_type,
        topology=node.accelerator_config.topology,
        runtime_version=node.runtime_version,
        labels=dict(node.labels),
        workers=workers,
        data_disks=disks,
        preemptible=node.scheduling_config.preemptible,
        spot=node.scheduling_config.spot,
        create_time=create_time,
    )


def host_keys(response, worker_indexes: list[int] | None) -> GuestHostKeys:
    """GetGuestAttributes answers one GuestAttributes per worker, in worker order (or in
    the order of the ``worker_ids`` asked for); entries are namespace/key/value."""
    answers = list(response.guest_attributes)
    indexes = worker_indexes if worker_indexes else list(range(len(answers)))
    workers: dict[int, dict[str, str]] = {}
    for index, attributes in zip(indexes, answers, strict=False):
        keys: dict[str, str] = {}
        for item in attributes.query_value.items:
            if item.namespace != "hostkeys":
                continue
            line = host_key_line(item.key, item.value)
            if line:
                keys[item.key] = line
        workers[index] = keys
    return GuestHostKeys(workers=workers)

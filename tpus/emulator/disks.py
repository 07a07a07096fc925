"""Data disks on emulated nodes, checked the way Compute Engine checks them: a disk
must exist, be in the node's zone, be listed once, and a read-write disk attaches to
one VM only. The same check serves an attach (UpdateNode with mask ``data_disks``),
a created node (CreateNode) and a queued resource that gets its capacity."""

from __future__ import annotations

import re
from collections.abc import Iterable

from grpc import StatusCode

from tpus.emulator.store import State

_DISK = re.compile(r"^projects/([^/]+)/zones/([^/]+)/disks/([^/]+)$")


class DiskRefused(Exception):
    """A disk list the API refuses, with the gRPC status it answers."""

    def __init__(self, code: StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def mode_name(mode) -> str:
    """A message's disk mode as stored; an unset mode is READ_WRITE, as the API
    documents."""
    return "READ_ONLY" if getattr(mode, "name", mode) == "READ_ONLY" else "READ_WRITE"


def checked(data: State, node: str, disks: Iterable[tuple[str, str]]) -> list[dict[str, str]]:
    """The node's new disk list from ``(source_disk, mode)`` pairs, or DiskRefused:
    unknown disk, other zone, listed twice, or a read-write disk another VM holds."""
    zone = node.split("/")[3]
    wanted: list[dict[str, str]] = []
    for source, mode in disks:
        match = _DISK.match(source)
        if not match:
            raise DiskRefused(StatusCode.INVALID_ARGUMENT, f"Malformed source_disk '{source}'")
        if source not in data["disks"]:
            raise DiskRefused(
                StatusCode.NOT_FOUND, f"The resource '{source}' of type 'Disk' was not found"
            )
        if match.group(2) != zone:
            raise DiskRefused(StatusCode.INVALID_ARGUMENT, f"Disk '{source}' is not in zone {zone}")
        if any(w["source_disk"] == source for w in wanted):
            raise DiskRefused(StatusCode.INVALID_ARGUMENT, f"Disk '{source}' is listed twice")
        for other, record in data["nodes"].items():
            if other == node:
                continue
            for attached in record["data_disks"]:
                if attached["source_disk"] == source and "READ_WRITE" in (mode, attached["mode"]):
                    raise DiskRefused(
                        StatusCode.FAILED_PRECONDITION,
                        f"The disk resource '{source}' is already being used by '{other}'"
                        f" ({attached['mode']}); a READ_WRITE disk attaches to one VM only",
                    )
        wanted.append({"source_disk": source, "mode": mode})
    return wanted

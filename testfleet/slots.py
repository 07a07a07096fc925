"""Fleet slots: several fleets can run on one machine at once (pytest-xdist workers,
two test runs, a demo), each in its own slot with its own subnet, names and state dir.

A slot is claimed with an exclusive ``flock`` on ``<root>/slot-<n>.lock`` for as long as
a process works with that fleet. Slot 0 is the command line's default; test sessions
take the first free slot from 1 up.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
from pathlib import Path

DEFAULT_ROOT = "/tmp/testfleet"  # noqa: S108 (root-only, 0700, flock-guarded)
# A private range no other part of this machine uses; each slot gets one /20 of it.
DEFAULT_NETWORK = "10.213.0.0/16"
SLOT_PREFIX = 20


class SlotBusy(RuntimeError):
    """Another process holds this slot's lock."""


def root_dir() -> Path:
    return Path(os.environ.get("TESTFLEET_ROOT", DEFAULT_ROOT))


def slot_count(network: str | None = None) -> int:
    net = ipaddress.ip_network(network or os.environ.get("TESTFLEET_NETWORK", DEFAULT_NETWORK))
    return 2 ** max(0, SLOT_PREFIX - net.prefixlen)


def slot_network(slot: int, network: str | None = None) -> ipaddress.IPv4Network:
    """The subnet of ``slot``: the slot-th /20 of the fleet range."""
    net = ipaddress.ip_network(network or os.environ.get("TESTFLEET_NETWORK", DEFAULT_NETWORK))
    if not net.is_private or net.version != 4:
        raise ValueError(f"the fleet range {net} must be a private IPv4 range")
    subnets = list(net.subnets(new_prefix=SLOT_PREFIX)) if net.prefixlen < SLOT_PREFIX else [net]
    if not 0 <= slot < len(subnets):
        raise ValueError(f"slot {slot} is outside 0..{len(subnets) - 1} for {net}")
    return subnets[slot]


class SlotLock:
    """An exclusive claim on one slot, released by ``release()`` or process exit."""

    def __init__(self, root: Path, slot: int, *, blocking: bool = False):
        self.root = root
        self.slot = slot
        self.path = root / f"slot-{slot}.lock"
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                raise SlotBusy(f"fleet slot {slot} is in use ({self.path})") from None
            # The file may have been removed by a teardown between open and flock.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd: int | None = fd

    def release(self, *, remove: bool = False) -> None:
        if self.fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
            try:
                self.root.rmdir()
            except OSError:
                pass  # other slots' files are still there
        os.close(self.fd)
        self.fd = None


def claim_free_slot(root: Path, first: int = 1) -> SlotLock:
    """Lock the first free slot from ``first`` up (wrapping around, never slot 0)."""
    count = slot_count()
    order = [s for s in range(first, count)] + [s for s in range(1, first)]
    for slot in order:
        try:
            return SlotLock(root, slot)
        except SlotBusy:
            continue
    raise SlotBusy(f"all {count - 1} fleet slots under {root} are in use")

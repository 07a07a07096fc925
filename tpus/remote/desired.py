"""What one TPU VM worker should look like, and the one encoder that sends it there.

The reconciler builds a ``DesiredState`` from the database and ``encode`` turns it into
the line-based text that ``scripts/reconcile.sh`` reads on stdin. The encoder checks
every field again with strict patterns, although the portal validated them when they
were entered: this is the last point before the bytes reach a root shell on a host, so
anything unexpected stops here with ValueError and nothing is sent. The script checks
the same patterns once more on the host.

The format (one record per line, fields separated by one space, see docs/reconcile.md)::

    tpu-portal-desired 1
    range <uid_min> <uid_max>
    version <series> <number>          (optional)
    user <name> <uid> <active 0|1> <sudo 0|1>
    key <name> <type> <base64> [<comment>]
    mount <device> <mount_point> <ro|rw>
    end

A stream without its header or its final ``end`` is refused whole, so a cut-off
transfer changes nothing. No Django here: this module is plain data.

``version`` orders the states sent to a host: the host keeps the highest number it
has applied for the series (one series per TPU VM) and refuses, changing nothing, a
state with a lower one. Two runs for one VM may meet on a host (a revoke that took
the VM over from a run that was still going, or that only seemed dead); whichever
order their scripts get the host's lock in, the newer state is the one that stays.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from tpus.remote import rules

HEADER = "tpu-portal-desired 1"
END = "end"

KEY_TYPES = rules.KEY_TYPES
# A 16384-bit RSA key is about 2,800 base64 characters.
MAX_KEY_BASE64 = 4096
MAX_KEYS_PER_USER = 64

# The lowest UID a portal user may get: below are the system's own accounts.
MIN_UID = 1000
MAX_UID = 2_000_000_000
# nobody / nogroup and the 16-bit "-1" mean something special to many tools.
RESERVED_UIDS = frozenset({65534, 65535})

_SERIES = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
MAX_VERSION = 10**18 - 1
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_COMMENT = re.compile(r"[A-Za-z0-9._@:+=/-]{1,100}")
# Key lines and mounts follow tpus/remote/rules.py, the portal's one home of these facts.
FORBIDDEN_MOUNT_TREES = rules.FORBIDDEN_MOUNT_TREES


@dataclass(frozen=True)
class DesiredUser:
    """One collaborator's account on the worker. ``keys`` are ``authorized_keys`` lines
    the portal rebuilt itself (``type base64 [comment]``). ``active=False`` means
    revoked: the account stays (locked, expired, no keys, no sudo, no processes) and
    so does the home directory."""

    username: str
    uid: int
    active: bool
    sudo: bool
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class DesiredMount:
    """A data disk attached to the VM, mounted by its Google device id."""

    device: str
    mount_point: str
    read_only: bool


@dataclass(frozen=True)
class DesiredState:
    """Everything the portal wants on one worker. ``uid_min``..``uid_max`` is the range
    the portal hands out; accounts there that it did not list are reported as drift."""

    users: tuple[DesiredUser, ...]
    mounts: tuple[DesiredMount, ...]
    uid_min: int
    uid_max: int
    # Which state of which VM this is (see the module's docstring); no ordering
    # when ``series`` is empty.
    series: str = ""
    version: int = 0


def encode(state: DesiredState) -> bytes:
    """The stdin of ``reconcile.sh`` for ``state``; raises ValueError on any field
    that is not exactly what the format allows."""
    uid_min, uid_max = _int(state.uid_min, "uid_min"), _int(state.uid_max, "uid_max")
    if not MIN_UID <= uid_min <= uid_max <= MAX_UID:
        raise ValueError(f"the UID range must lie within {MIN_UID}..{MAX_UID}")
    lines = [HEADER, f"range {uid_min} {uid_max}"]
    if state.series:
        if not isinstance(state.series, str) or not _SERIES.fullmatch(state.series):
            raise ValueError("a series is 1-64 of a-z, 0-9 and '-', not starting with '-'")
        version = _int(state.version, "version")
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"the version must lie within 0..{MAX_VERSION}")
        lines.append(f"version {state.series} {version}")
    names: set[str] = set()
    uids: set[int] = set()
    for user in _sequence(state.users, "users"):
        if not isinstance(user, DesiredUser):
            raise ValueError("users must be DesiredUser")
        name = check_username(user.username)
        uid = _int(user.uid, f"uid of {name}")
        if not uid_min <= uid <= uid_max or uid in RESERVED_UIDS:
            raise ValueError(f"uid {uid} of {name} is outside {uid_min}..{uid_max}")
        if name in names or uid in uids:
            raise ValueError(f"{name} or uid {uid} is listed twice")
        names.add(name)
        uids.add(uid)
        active, sudo = _bool(user.active, "active"), _bool(user.sudo, "sudo")
        keys = [check_key_line(line) for line in _sequence(user.keys, "keys")]
        if len(keys) > MAX_KEYS_PER_USER:
            raise ValueError(f"{name} has more than {MAX_KEYS_PER_USER} keys")
        # Revoked wins: a revoked user gets neither keys nor sudo, whatever else says so.
        lines.append(f"user {name} {uid} {int(active)} {int(sudo and active)}")
        if active:
            lines.extend(f"key {name} {key}" for key in keys)
    devices: set[str] = set()
    points: set[str] = set()
    for mount in _sequence(state.mounts, "mounts"):
        if not isinstance(mount, DesiredMount):
            raise ValueError("mounts must be DesiredMount")
        device = check_device(mount.device)
        point = check_mount_point(mount.mount_point)
        if device in devices or point in points:
            raise ValueError(f"{device} or {point} is listed twice")
        devices.add(device)
        points.add(point)
        mode = "ro" if _bool(mount.read_only, "read_only") else "rw"
        lines.append(f"mount {device} {point} {mode}")
    lines.append(END)
    return ("\n".join(lines) + "\n").encode("ascii")


def check_username(value: object) -> str:
    if not rules.is_username(value):
        raise ValueError("a username is 1-31 of a-z, 0-9 and '-', starting with a letter")
    return value


def check_key_line(value: object) -> str:
    """``type base64 [comment]``: an allowed type, canonical base64 whose inner type is
    the stated one, and at most a one-token comment. No options, no second key."""
    if not isinstance(value, str) or not value.isascii():
        raise ValueError("a key line must be ASCII text")
    parts = value.split(" ")
    if len(parts) not in (2, 3):
        raise ValueError("a key line is 'type base64' or 'type base64 comment'")
    key_type, data = parts[0], parts[1]
    if key_type not in KEY_TYPES:
        raise ValueError("the key type is not allowed")
    if len(data) > MAX_KEY_BASE64 or not _BASE64.fullmatch(data):
        raise ValueError("the key is not strict base64")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the key is not strict base64") from None
    if base64.b64encode(blob).decode() != data:
        raise ValueError("the key's base64 is not canonical")
    if _inner_type(blob) != key_type:
        raise ValueError("the key's data does not match its type")
    if len(parts) == 3 and not _COMMENT.fullmatch(parts[2]):
        raise ValueError("a key comment is one token of letters, digits and ._@:+=/-")
    return value


def check_device(value: object) -> str:
    if not rules.is_device(value):
        raise ValueError("a device name is a-z, 0-9 and '-', starting with a letter")
    return value


def check_mount_point(value: object) -> str:
    """An absolute path of plain parts (no '.', '..', doubled or trailing slashes),
    outside the system's own trees and the homes (``rules.mount_point_problem``)."""
    if (problem := rules.mount_point_problem(value)) is not None:
        raise ValueError(problem)
    return value  # type: ignore[return-value]


def _inner_type(blob: bytes) -> str:
    if len(blob) < 4:
        return ""
    (length,) = struct.unpack(">I", blob[:4])
    if length > len(blob) - 4:
        return ""
    return blob[4 : 4 + length].decode("ascii", errors="replace")


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False")
    return value


def _sequence(value: object, what: str) -> Iterable:
    # A str is iterable too: a single key passed without its tuple must not be split
    # into characters.
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
        raise ValueError(f"{what} must be a tuple")
    return value

"""Pinned host keys of one worker, as the Cloud TPU API's guest attributes give them."""

from __future__ import annotations

import base64
import binascii
import functools
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import paramiko
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

# Verification speed and strength: ed25519 first; paramiko asks the server for the
# first pinned type.
_ORDER = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
)


class InvalidHostKey(ValueError):
    """A host key string that is not one well-formed public key of an allowed type."""


def _inner_type(blob: bytes) -> str:
    if len(blob) < 4:
        raise InvalidHostKey("the key is truncated")
    (length,) = struct.unpack(">I", blob[:4])
    if length > len(blob) - 4:
        raise InvalidHostKey("the key is truncated")
    return blob[4 : 4 + length].decode("ascii", errors="replace")


@functools.lru_cache(maxsize=4096)
def canonical(line: str) -> str:
    """``"<type> <base64>"`` from one public key line (a trailing comment is dropped).
    Remembered by line (a refused line is checked again): every pass over a pod reads
    each worker's pins, and loading a key to check it costs about a millisecond."""
    if any(ch in line for ch in "\r\n\0"):
        raise InvalidHostKey("a host key must be one line")
    parts = line.split()
    if len(parts) < 2:
        raise InvalidHostKey("expected '<type> <base64>'")
    key_type, data = parts[0], parts[1]
    if key_type not in _ORDER:
        raise InvalidHostKey(f"host key type {key_type!r} is not accepted")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidHostKey("the key is not valid base64") from None
    if _inner_type(blob) != key_type:
        raise InvalidHostKey("the key's type does not match its data")
    # cryptography refuses truncated keys and trailing bytes (paramiko accepts both);
    # re-encoding must give back exactly the blob we were given.
    text = f"{key_type} {base64.b64encode(blob).decode()}"
    try:
        loaded = serialization.load_ssh_public_key(text.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise InvalidHostKey(f"the key cannot be loaded: {exc}") from None
    again = loaded.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if again.split()[1] != text.split()[1].encode():
        raise InvalidHostKey("the key is not in canonical form")
    return f"{key_type} {base64.b64encode(blob).decode()}"


@dataclass(frozen=True)
class HostKeyPins:
    """The host keys a worker must present, as ``"<type> <base64>"`` strings."""

    keys: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str | Iterable[str]) -> HostKeyPins:
        """From key lines (a string with one key per line, or an iterable of lines)."""
        lines = value.splitlines() if isinstance(value, str) else list(value)
        keys = {canonical(line) for line in lines if line.strip()}
        ordered = sorted(keys, key=lambda k: (_ORDER.index(k.split()[0]), k))
        return cls(tuple(ordered))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def paramiko_keys(self) -> list[paramiko.PKey]:
        keys = []
        for key in self.keys:
            key_type, data = key.split()
            keys.append(paramiko.PKey.from_type_string(key_type, base64.b64decode(data)))
        return keys

"""Helpers for the key tests: fresh keys, the private keys people paste by mistake, and
the checks that such a key went nowhere (no row, no log line, no page, no report)."""

from __future__ import annotations

import logging
import traceback

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

PUTTY_V3 = """PuTTY-User-Key-File-3: ssh-ed25519
Encryption: none
Comment: eddsa-key-20240101
Public-Lines: 2
AAAAC3NzaC1lZDI1NTE5AAAAIN8crqCQZGXDCh9KBbBRI4EGkWOX2SOeVCa1joX0
XTan
Private-Lines: 1
AAAAIPuttyPrivatePartThatMustNeverBeEchoedBackToAnyoneAtAll0000
Private-MAC: 6b1c4a5fbd0e2a9d3c0f4b1a2e3d4c5b6a7980a1b2c3d4e5f60718293a4b5c6d
"""

# (ssh-keygen -t, -m, passphrase) for the private keys made at test time.
PRIVATE_KEY_KINDS = [
    ("ed25519", "RFC4716", ""),
    ("ed25519", "RFC4716", "correct horse"),
    ("rsa", "PEM", ""),
    ("ecdsa", "PEM", ""),
    ("rsa", "PKCS8", ""),
]
PRIVATE_KEY_IDS = ["openssh", "openssh-encrypted", "pem-rsa", "pem-ec", "pkcs8"]


def fresh_key(comment: str = "someone@laptop") -> str:
    """A new, valid ed25519 public key line (its private half is thrown away)."""
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return f"{line.decode()} {comment}".rstrip()


def secret_fragments(secret: str) -> list[str]:
    """The lines of a private key that are secret: long base64 runs, not headers such
    as "Encryption: none" or "-----BEGIN …"."""
    fragments = []
    for line in secret.splitlines():
        fragment = line.strip()
        if len(fragment) >= 16 and ":" not in fragment and not fragment.startswith("-"):
            fragments.append(fragment)
    assert fragments, "a private key with nothing secret in it tests nothing"
    return fragments


def logged_text(records: list[logging.LogRecord]) -> str:
    """Everything the log records say: messages, arguments and tracebacks."""
    parts = []
    for record in records:
        parts.append(record.getMessage())
        parts.append(repr(record.args))
        if record.exc_info:
            parts.append("".join(traceback.format_exception(*record.exc_info)))
        if record.exc_text:
            parts.append(record.exc_text)
    return "\n".join(parts)


def assert_not_in(secret: str, *places: str) -> None:
    for fragment in secret_fragments(secret):
        for place in places:
            assert fragment not in place


def audit_text() -> str:
    from tpus.models import AuditEvent

    return repr(list(AuditEvent.objects.values()))

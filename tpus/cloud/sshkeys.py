"""Editing a node's ``ssh-keys`` metadata value one line at a time.

The value is lines of ``user:<type> <base64> [comment]``, as gcloud and the console
write them and as Google's guest agent reads them. An edit adds or removes one line
and keeps every other byte as it was (other lines, their order, blank lines, a final
newline or its absence, ``\\r\\n`` endings), so an admin's own keys survive.
"""

from __future__ import annotations

from dataclasses import dataclass

SSH_KEYS = "ssh-keys"
OSLOGIN = "enable-oslogin"
BLOCK_PROJECT_KEYS = "block-project-ssh-keys"


@dataclass(frozen=True)
class KeyLine:
    """One ``ssh-keys`` line the portal owns: ``user:type base64 comment``."""

    user: str
    public_line: str  # "ssh-ed25519 AAAA… comment"

    def __post_init__(self):
        words = self.public_line.split()
        if ":" in self.user or not self.user or any(c.isspace() for c in self.user):
            raise ValueError(f"not a usable account name for ssh-keys: {self.user!r}")
        if len(words) < 2 or "\n" in self.public_line or "\r" in self.public_line:
            raise ValueError("an ssh-keys line needs one OpenSSH public key on one line")

    @property
    def text(self) -> str:
        return f"{self.user}:{self.public_line.strip()}"

    @property
    def identity(self) -> tuple[str, str, str]:
        """Account, key type and key blob: what makes a line ours, whatever its comment."""
        words = self.public_line.split()
        return (self.user, words[0], words[1])


def _identity(line: str) -> tuple[str, str, str] | None:
    user, sep, rest = line.strip().partition(":")
    words = rest.split()
    if not sep or len(words) < 2:
        return None
    return (user, words[0], words[1])


def has_line(value: str, key: KeyLine) -> bool:
    return any(_identity(line) == key.identity for line in value.split("\n"))


def with_line(value: str, key: KeyLine) -> str:
    """``value`` with ``key``'s line appended, or ``value`` itself when it is there."""
    if has_line(value, key):
        return value
    if not value:
        return key.text
    ending = "\r\n" if value.endswith("\r\n") else "\n"
    if value.endswith("\n"):
        return value + key.text + ending
    return value + "\n" + key.text


def without_line(value: str, key: KeyLine) -> str:
    """``value`` without ``key``'s line (every copy of it); the rest byte for byte."""
    lines = value.split("\n")
    kept = [line for line in lines if _identity(line) != key.identity]
    return value if len(kept) == len(lines) else "\n".join(kept)


def is_true(value: str | None) -> bool:
    """How the guest agent reads a boolean metadata value."""
    return (value or "").strip().lower() in {"true", "1", "yes", "on"}

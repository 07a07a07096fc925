"""The scripts the portal runs on workers: real files in ``scripts/``, never built
from strings at run time."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

SCRIPTS_DIR = Path(__file__).with_name("scripts")
_NAME = re.compile(r"^[a-z][a-z0-9_-]*\.sh$")
# The script travels as one argument of ``sh -c``; Linux caps one argument at 128 KiB.
MAX_SCRIPT_BYTES = 100_000


@dataclass(frozen=True)
class Script:
    """A shell script: its file name (also its ``$0`` on the host) and its text."""

    name: str
    body: bytes

    @classmethod
    def from_path(cls, path: Path) -> Script:
        if not _NAME.match(path.name):
            raise ValueError(f"script names look like 'add-user.sh', not {path.name!r}")
        body = path.read_bytes()
        if len(body) > MAX_SCRIPT_BYTES or b"\0" in body:
            raise ValueError(f"{path.name} is too large or not text")
        return cls(path.name, body)


@functools.cache
def load(name: str) -> Script:
    """A script that ships with the portal, by file name (``"whoami.sh"``)."""
    if not _NAME.match(name):
        raise ValueError(f"no such script {name!r}")
    return Script.from_path(SCRIPTS_DIR / name)

"""The scripts the portal runs on workers: real files in ``scripts/``, never built
from strings at run time.

A script is either one file (``scripts/whoami.sh``) or a folder of parts
(``scripts/reconcile/NN-*.sh`` for ``reconcile.sh``), each part readable on its own,
joined here in name order into the one text that travels: one SSH round trip, one
``sh -c``, whatever the number of parts. This is the only place that joins them."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

SCRIPTS_DIR = Path(__file__).with_name("scripts")
_NAME = re.compile(r"^[a-z][a-z0-9_-]*\.sh$")
_PART = re.compile(r"^[0-9]{2}-[a-z][a-z0-9-]*\.sh$")
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
        return cls._checked(path.name, path.read_bytes())

    @classmethod
    def from_parts(cls, name: str, parts: list[Path]) -> Script:
        """``name`` made of ``parts`` (``NN-what.sh``), joined in the order given."""
        if not _NAME.match(name):
            raise ValueError(f"script names look like 'add-user.sh', not {name!r}")
        if not parts or any(not _PART.match(p.name) for p in parts):
            raise ValueError(f"the parts of {name} are named like '10-input.sh'")
        return cls._checked(name, b"".join(p.read_bytes() for p in parts))

    @classmethod
    def _checked(cls, name: str, body: bytes) -> Script:
        if len(body) > MAX_SCRIPT_BYTES or b"\0" in body:
            raise ValueError(f"{name} is too large or not text")
        return cls(name, body)


def parts(name: str) -> list[Path]:
    """The part files of a script kept as a folder (``reconcile.sh`` →
    ``scripts/reconcile/*.sh``), in the order they are joined; [] for a one-file
    script."""
    if not _NAME.match(name):
        raise ValueError(f"no such script {name!r}")
    folder = SCRIPTS_DIR / name.removesuffix(".sh")
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix == ".sh")


@functools.cache
def load(name: str) -> Script:
    """A script that ships with the portal, by name (``"whoami.sh"``,
    ``"reconcile.sh"``)."""
    if found := parts(name):
        return Script.from_parts(name, found)
    return Script.from_path(SCRIPTS_DIR / name)


def shipped() -> list[Script]:
    """Every script the portal runs on workers, as it travels."""
    names = {p.name for p in SCRIPTS_DIR.glob("*.sh")}
    names |= {f"{d.name}.sh" for d in SCRIPTS_DIR.iterdir() if d.is_dir()}
    return [load(n) for n in sorted(names)]

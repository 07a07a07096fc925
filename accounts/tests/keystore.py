"""Keys the real ``ssh-keygen`` makes for the key tests, each made once per test run
and shared by every test process of the run (pytest-xdist's workers wait on a file
lock for the one that makes it). Nothing here has a timeout: a 4096-bit RSA key takes
as long as it takes on a loaded machine, and a test never fails for it."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from pathlib import Path


def run_keygen(*args: str) -> str:
    """``ssh-keygen`` with ``args``; its stdout. Fails loudly with what it printed."""
    result = subprocess.run(
        ["ssh-keygen", *args], capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    if result.returncode != 0:
        raise RuntimeError(f"ssh-keygen {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def shared_folder(tmp_path_factory) -> Path:
    """A folder every process of this run sees: the run's own base folder, which
    pytest-xdist's workers share (each worker's base folder lies inside it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / "ssh-keygen-keys"
    folder.mkdir(exist_ok=True)
    return folder


class KeyStore:
    """Key pairs in ``folder``, made on first ask: ``path(name, *args)`` is the private
    key's path, ``args`` the ``ssh-keygen`` options that make it (``-f`` is added)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, name: str, *args: str) -> Path:
        path = self.folder / name
        done = path.with_name(name + ".done")
        if done.exists():
            return path
        with open(self.folder / (name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                for stale in (path, path.with_name(name + ".pub")):
                    stale.unlink(missing_ok=True)
                run_keygen("-q", *args, "-f", str(path))
                done.touch()
        return path

    def private_key(self, key_type: str, fmt: str, passphrase: str) -> str:
        """The text of a private key of ``key_type`` in ``fmt`` (ssh-keygen's ``-m``)
        with ``passphrase``, as someone might paste it."""
        tag = hashlib.sha256(passphrase.encode()).hexdigest()[:8]
        args = ["-t", key_type, "-m", fmt, "-N", passphrase]
        if key_type == "rsa":
            args += ["-b", "2048"]
        return self.path(f"private-{key_type}-{fmt}-{tag}", *args).read_text()

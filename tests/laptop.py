"""A collaborator's machine for the real ssh client: a home directory of its own.

OpenSSH expands ``~`` from the password database, not from ``$HOME``, so a config that
says ``UserKnownHostsFile ~/.ssh/tpu-portal_known_hosts`` can only be tested in a
home the test owns by putting that directory over the real home: each command runs in
a private mount namespace (``unshare``, so root, as the fleet needs anyway) where the
temporary directory is bind-mounted on the account's home. Nothing outside the command
sees it, and ``-o UserKnownHostsFile=…`` is never needed: the files are where the
portal says they go.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.requirements import need

_ENTER = 'mount --bind "$0" "$1" && cd "$2" && shift 2 && exec "$@"'


class Laptop:
    def __init__(self, root: Path):
        need(os.geteuid() == 0, "the ssh client's own home needs root (a mount namespace)")
        need(shutil.which("unshare") is not None, "needs unshare (util-linux)")
        need(shutil.which("ssh") is not None, "needs OpenSSH's ssh client")
        self.root = root  # what is the home inside the commands
        self.real_home = pwd.getpwuid(os.getuid()).pw_dir
        # A runtime folder of its own, as each person's login has (the client keeps its
        # shared connections there): laptops of one test run never meet in /tmp. Short,
        # as a socket's path has a length limit.
        self.runtime = tempfile.mkdtemp(prefix="l", dir="/tmp")  # as long as /run/user/1000
        atexit.register(shutil.rmtree, self.runtime, ignore_errors=True)
        (root / ".ssh").mkdir(parents=True, exist_ok=True, mode=0o700)
        (root / "Downloads").mkdir(exist_ok=True)

    def path(self, inside: str) -> Path:
        """Where ``~/…`` of the commands is, seen from the test."""
        return self.root / inside.removeprefix("~/")

    def _argv(self, args: list[str], cwd: str) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _ENTER,
                str(self.root), self.real_home, cwd, *args]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.real_home,
            "XDG_RUNTIME_DIR": self.runtime,
        }

    def run(self, args: list[str], *, cwd: str = "/", timeout: float = 30):
        """A command at home (stdin closed, so ssh can never wait for an answer)."""
        return subprocess.run(
            self._argv(args, cwd), capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL, env=self._env(),
        )  # fmt: skip

    def start(self, args: list[str], *, cwd: str = "/") -> subprocess.Popen:
        """A long-running command (``ssh -N``); the caller stops it."""
        return subprocess.Popen(
            self._argv(args, cwd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=self._env(),
        )  # fmt: skip

    def shell(self, script: str):
        """A shell script as the person would paste it into a terminal."""
        return self.run(["sh", "-c", script], cwd=self.real_home)

    def ssh(self, *args: str, cwd: str = "/"):
        """``ssh`` with the person's own files; BatchMode, so a prompt is a failure."""
        return self.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *args], cwd=cwd)


def new_key(laptop: Laptop) -> str:
    """The person's default key, ``~/.ssh/id_ed25519``; returns the public line."""
    path = laptop.path("~/.ssh/id_ed25519")
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "milo@laptop", "-f", str(path)],
        check=True,
    )
    return path.with_suffix(".pub").read_text().strip()


class ClientLaptop(Laptop):
    """A laptop where programs of this checkout's Python run too (the ``tpu`` client):
    when that Python lives in the real home (pyenv under /root), it is bind-mounted
    read-only at the same place in the laptop's home, and nothing else of the real
    home is seen."""

    _ENTER_WITH_PYTHON = (
        'mkdir -p "$0/$3" && mount --bind -o ro "$1/$3" "$0/$3" && '
        'mount --rbind "$0" "$1" && cd "$2" && shift 3 && exec "$@"'
    )

    def _argv(self, args: list[str], cwd: str) -> list[str]:
        base, home = Path(sys.base_prefix), Path(self.real_home)
        if not base.is_relative_to(home):
            return super()._argv(args, cwd)
        inside = str(base.relative_to(home))
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                self._ENTER_WITH_PYTHON, str(self.root), self.real_home, cwd, inside,
                *args]  # fmt: skip

"""Small wrappers around the machine: commands, ``ip -batch``, and processes by pid.

Processes are always identified by (pid, start time) so a recycled pid is never
signalled by mistake.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass


class FleetError(RuntimeError):
    """Something the fleet needed from the machine did not work."""


def run(args: list[str], *, input: bytes | None = None, check: bool = True, timeout: float = 30):
    """Run a command, capture its output; raise FleetError with its stderr on failure."""
    proc = subprocess.run(args, input=input, capture_output=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip()
        raise FleetError(f"{' '.join(args)} failed ({proc.returncode}): {detail}")
    return proc


def ip_batch(lines: Iterable[str], *, force: bool = False, netns: str | None = None) -> None:
    """Run many ``ip`` commands in one process; with ``force`` errors are ignored."""
    text = "".join(f"{line}\n" for line in lines)
    if not text:
        return
    args = ["ip"]
    if netns:
        args += ["-n", netns]
    if force:
        args.append("-force")
    run([*args, "-batch", "-"], input=text.encode(), check=not force)


def list_netns() -> list[str]:
    proc = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.decode().splitlines() if line.strip()]


def list_links() -> list[str]:
    return sorted(os.listdir("/sys/class/net"))


@dataclass(frozen=True)
class Pid:
    """A process as (pid, start time in clock ticks since boot)."""

    pid: int
    start: int

    def to_json(self) -> list[int]:
        return [self.pid, self.start]

    @classmethod
    def from_json(cls, value) -> Pid | None:
        return cls(int(value[0]), int(value[1])) if value else None


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses; fields follow the last ')'.
    return text[text.rindex(")") + 2 :].split()


def pid_of(pid: int) -> Pid | None:
    fields = _stat(pid)
    return None if fields is None else Pid(pid, int(fields[19]))


def alive(proc: Pid | None) -> bool:
    """True while the very process we started runs (a zombie counts as gone)."""
    if proc is None:
        return False
    fields = _stat(proc.pid)
    return fields is not None and int(fields[19]) == proc.start and fields[0] not in "ZX"


def kill(proc: Pid | None, sig: int = signal.SIGKILL) -> None:
    if alive(proc):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def wait_gone(procs: Iterable[Pid | None], timeout: float = 10) -> None:
    pending = [p for p in procs if p is not None]
    deadline = time.monotonic() + timeout
    while pending:
        pending = [p for p in pending if alive(p)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise FleetError(f"processes did not exit: {[p.pid for p in pending]}")
        time.sleep(0.01)


def children_of(parents: set[int]) -> dict[int, int]:
    """{parent pid: child pid} for the given parents, from one scan of /proc."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None and int(fields[1]) in parents:
            found[int(fields[1])] = int(entry)
    return found


def listening_on(pid: int, port: int) -> bool:
    """Whether the network namespace of ``pid`` has a TCP socket listening on ``port``."""
    want = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                next(handle)
                for line in handle:
                    fields = line.split()
                    if fields[1].endswith(want) and fields[3] == "0A":
                        return True
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return False

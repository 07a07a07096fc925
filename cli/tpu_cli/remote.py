"""The person's own ``ssh`` and ``rsync``, on every worker of a VM at once: a command
with its output prefixed per worker (``(w3) …``), and a folder synced to the same
path under the home on every worker."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from tpu_cli.errors import USAGE, CliError

BATCH = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
_print_lock = threading.Lock()


def remote_command(words: list[str]) -> str:
    """What ssh runs: one word is a shell command line as written (``'cd x && make'``),
    several are quoted word by word, so each arrives as it was typed."""
    return words[0] if len(words) == 1 else shlex.join(words)


def prefixed(label: str, stream: IO[bytes], out: IO[str]) -> None:
    """Copy ``stream`` to ``out`` line by line, each line after ``label``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        with _print_lock:
            out.write(f"{label}{line}\n" if label else f"{line}\n")
            out.flush()


def label_for(index: int, show: bool) -> str:
    return f"(w{index}) " if show else ""


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def run_everywhere(
    ssh: list[str], hosts: dict[int, str], command: str, *, label: bool = True
) -> dict[int, int]:
    """``command`` on every host at once; returns each worker's exit status (255: ssh
    itself failed)."""
    procs = {i: start([*ssh, *BATCH, host, command]) for i, host in hosts.items()}
    threads = []
    for index, proc in procs.items():
        tag = label_for(index, label)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            thread = threading.Thread(target=prefixed, args=(tag, stream, out), daemon=True)
            thread.start()
            threads.append(thread)
    codes = {index: proc.wait() for index, proc in procs.items()}
    for thread in threads:
        thread.join()
    return codes


# --- rsync ------------------------------------------------------------------------------

_ITEM = re.compile(r"^([<>ch.*][fdLDS][^ ]*) (.+)$")
_PROGRESS = re.compile(r"^\s*[\d,.]+[KMG]?\s+(\d+)%")
_version: tuple | None = None


def rsync_version() -> tuple:
    global _version
    if _version is None:
        try:
            out = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout
        except FileNotFoundError:
            raise CliError("rsync is not installed; install it to sync a workdir.", USAGE) from None
        found = re.search(r"version\s+(\d+)\.(\d+)", out)
        _version = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    return _version


@dataclass
class Synced:
    """What one rsync moved: the files it sent (their paths in the workdir)."""

    status: int = 0
    files: list[str] = field(default_factory=list)
    error: str = ""


def rsync_argv(ssh: list[str], local: Path, host: str, remote: str) -> list[str]:
    argv = ["rsync", "-a", "--filter=:- .gitignore", "--exclude=/.git", "--out-format=%i %n"]
    if rsync_version() >= (3, 1):
        argv.append("--info=progress2")
    # The folder and its parents are made on the worker first (--mkpath needs 3.2.3
    # on both ends).
    argv += ["--rsync-path", f"mkdir -p {shlex.quote(remote)} && rsync"]
    argv += ["-e", shlex.join([*ssh, *BATCH]), f"{local}/", f"{host}:{remote}/"]
    return argv


def rsync_one(argv: list[str], on_percent: Callable[[int], None]) -> Synced:
    """Run one rsync, reporting its progress; returns what it moved."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    result = Synced()
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    reader.start()
    buffer = b""
    while True:
        chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = re.split(rb"[\r\n]", buffer)
        for raw in lines:
            _line(raw.decode("utf-8", errors="replace"), result, on_percent)
    _line(buffer.decode("utf-8", errors="replace"), result, on_percent)
    result.status = proc.wait()
    reader.join()
    result.error = b"".join(errors).decode("utf-8", errors="replace").strip()
    return result


def _line(line: str, result: Synced, on_percent: Callable[[int], None]) -> None:
    item = _ITEM.match(line)
    if item:
        if item.group(1)[0] in "<>" and item.group(1)[1] == "f":
            result.files.append(item.group(2))
        return
    progress = _PROGRESS.match(line)
    if progress:
        on_percent(int(progress.group(1)))


def sync_parallel(
    jobs: dict[int, list[str]], on_percent: Callable[[int, int], None]
) -> dict[int, Synced]:
    """Every rsync at once (``jobs``: worker index -> argv)."""
    results: dict[int, Synced] = {}

    def one(index: int, argv: list[str]) -> None:
        results[index] = rsync_one(argv, lambda pct: on_percent(index, pct))
        on_percent(index, 100)

    threads = [threading.Thread(target=one, args=item, daemon=True) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def via_worker0_command(remote: str, targets: list[tuple], known_hosts: str) -> tuple:
    """The command run on worker 0 (with the agent forwarded) that rsyncs ``remote``
    to the other workers at once, checking their pinned host keys; and its stdin (the
    VM's known_hosts lines). ``targets``: (index, user@address, HostKeyAlias)."""
    lines = [
        "set -u",
        'kh=$(mktemp) && trap \'rm -f "$kh"\' EXIT && cat > "$kh"',
        "pids=''",
    ]
    for index, destination, alias in targets:
        ssh = (
            f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile=$kh"
            f" -o HostKeyAlias={shlex.quote(alias)}"
        )
        lines.append(
            f"( rsync -a --filter=':- .gitignore' --exclude=/.git --out-format='(w{index}) %i %n'"
            f" --rsync-path={shlex.quote(f'mkdir -p {shlex.quote(remote)} && rsync')}"
            f' -e "{ssh}" {shlex.quote(remote + "/")}'
            f" {shlex.quote(destination + ':' + remote + '/')}"
            f" || echo 'tpu-sync-failed w{index}' ) &"
        )
        lines.append('pids="$pids $!"')
    lines.append("wait $pids")
    return "\n".join(lines), known_hosts

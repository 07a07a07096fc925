"""One ssh connection per worker, shared (OpenSSH's ControlMaster) between a command's
ssh and rsync sessions and the next commands', its sockets in a folder of the person's
own: ``$XDG_RUNTIME_DIR/tpu-portal``, or where that is too long a path for a socket, a
short private folder in /tmp."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpu_cli import paths

# How long a worker's shared connection stays open once its last session ended, for the
# next command (the next `tpu run` of an edit-run loop).
PERSIST_SECONDS = 300
# A socket's path is at most 104 bytes on macOS (108 on Linux); ssh adds a 17-byte
# suffix while it makes one, and %C is 40.
_SOCKET_PATH_MAX = 104 - 17 - 41
# How long an empty folder of connections made for other files is kept (see ``shared``).
_YOUNG_SECONDS = 60


# Where the short folders are made when the runtime folder is too long a path (not
# $TMPDIR, which on macOS is itself too long a prefix for a socket).
TMP = Path("/tmp")  # noqa: S108


def _bases() -> list[Path]:
    """Where the person's shared connections may be, in order: ``$XDG_RUNTIME_DIR/
    tpu-portal`` (a per-user directory the system empties at logout), then
    ``/tmp/tpu-portal-<uid>``. Each is checked before use to be the person's own, 0700
    and not a link (``_own_private_dir``)."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        found.append(Path(runtime) / "tpu-portal")
    found.append(TMP / f"tpu-portal-{os.getuid()}")
    return found


def _recorded_base(make: bool) -> Path | None:
    """A folder with a random short name in /tmp, for when ``/tmp/tpu-portal-<uid>`` is
    someone else's; its name is kept in the person's config folder so the next command
    shares the same connections."""
    pointer = paths.config_dir() / "connections-folder"
    try:
        recorded = Path(pointer.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        recorded = None
    if recorded is not None and recorded.parent == TMP and recorded.name.startswith("tpu-"):
        if _own_private_dir(recorded):
            return recorded
    if not make:
        return None
    try:
        made = Path(tempfile.mkdtemp(prefix="tpu-", dir=str(TMP)))
        paths.private_dir(paths.config_dir())
        paths.write_private(pointer, f"{made}\n")
    except OSError:
        return None
    return made if _own_private_dir(made) else None


def _own_private_dir(path: Path) -> bool:
    """Whether ``path`` is (or was just made) a directory of this user's, 0700: never one
    someone else made or a symlink, where another user could reach the sockets."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return True


def _short_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def _home_sockets(base: Path) -> Path:
    """This home's folder of sockets in ``base`` (one account may have several homes,
    each with its own portal files)."""
    return base / _short_hash(str(paths.home()).encode())


def _fits(home: Path) -> bool:
    return len(str(home / _generation())) <= _SOCKET_PATH_MAX


def _usable_home() -> tuple[Path | None, str]:
    """The first folder of sockets for this home whose path is short enough and whose
    base is the person's own; else None and why."""
    why = []
    for base in _bases():
        home = _home_sockets(base)
        if not _fits(home):
            why.append(f"{base} is too long a path for a socket")
        elif not _own_private_dir(base):
            why.append(f"{base} is not a private folder of yours")
        else:
            return home, ""
    for make in (False, True):
        base = _recorded_base(make)
        if base is not None and _fits(_home_sockets(base)):
            return _home_sockets(base), ""
    why.append(f"no private folder could be made in {TMP}")
    return None, "; ".join(why)


_warned = False


def _warn(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        sys.stderr.write(
            f"tpu: not sharing ssh connections between sessions ({why}); each ssh and "
            "rsync logs in to its worker anew, which is slower.\n"
        )


def _generation() -> str:
    """A name for the portal's files as they are now: a changed address or host key
    makes a new one, so a connection made before the change is never used after it."""
    content = b""
    for path in (paths.ssh_config_file(), paths.known_hosts_file()):
        try:
            content += path.read_bytes() + b"\0"
        except FileNotFoundError:
            content += b"\0"
    return _short_hash(content)


def _tidy(folder: Path, ssh: list[str] | None = None, *, keep_if_younger: float = 0) -> None:
    """Remove the sockets in ``folder`` whose connection has ended, and the folder once
    it is empty, unless it was changed less than ``keep_if_younger`` seconds before
    (looked at first: removing a socket changes it); with ``ssh``, close the live
    connections first."""
    try:
        young = time.time() - folder.stat().st_mtime < keep_if_younger
    except OSError:
        return
    for path in folder.iterdir():
        if ssh is not None:
            # Any host name: the socket says which connection.
            subprocess.run([*ssh, "-o", f"ControlPath={path}", "-O", "exit", "tpu-portal"],
                           stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            probe.close()
    if young:
        return
    try:
        folder.rmdir()
    except OSError:
        pass


def _folders(home: Path) -> list[Path]:
    if not home.is_dir() or home.is_symlink() or not _own_private_dir(home):
        return []
    return [f for f in home.iterdir() if f.is_dir() and not f.is_symlink()]


def close_shared(ssh: list[str]) -> None:
    """Close the shared connections to the workers the portal's files name now (at
    sign-out); those made before the files changed are no longer used and end by
    themselves."""
    bases = [base for base in (*_bases(), _recorded_base(False)) if base is not None]
    for base in bases:
        home = _home_sockets(base)
        for folder in _folders(home):
            _tidy(folder, ssh if folder.name == _generation() else None)
        try:
            home.rmdir()
        except OSError:
            pass


def shared(ssh: list[str], host: str) -> list[str]:
    """``ssh`` that shares one connection per worker (OpenSSH's ControlMaster) between
    this command's ssh and rsync sessions and the next commands', for
    ``PERSIST_SECONDS`` after the last session: a worker's second session skips the key
    exchange and the login. The connection is made and its host key checked as the
    person's ssh config says (the pinned keys, StrictHostKeyChecking). ``ssh`` as it is
    when the person's own config shares connections already (their ControlPath wins),
    or, said on stderr, when no private place for the sockets can be made."""
    effective = subprocess.run([*ssh, "-G", host], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True)  # fmt: skip
    options = dict(line.partition(" ")[::2] for line in effective.stdout.splitlines())
    if effective.returncode != 0 or options.get("controlpath", "none") != "none":
        return ssh
    if options.get("controlmaster", "false") != "false":
        return ssh
    home, why = _usable_home()
    if home is None:
        _warn(why)
        return ssh
    folder = home / _generation()
    for old in _folders(home):
        # Connections made before the files changed are never used again; they end by
        # themselves (a session in another terminal may still use one). A folder made
        # in the last minute stays even when empty: another command of the person's,
        # started before the files changed, may be about to open its connections there.
        if old != folder:
            _tidy(old, keep_if_younger=_YOUNG_SECONDS)
    if not _own_private_dir(home) or not _own_private_dir(folder):
        _warn(f"{folder} could not be made a private folder of yours")
        return ssh
    return [*ssh, "-o", "ControlMaster=auto", "-o", f"ControlPath={folder}/%C",
            "-o", f"ControlPersist={PERSIST_SECONDS}"]  # fmt: skip

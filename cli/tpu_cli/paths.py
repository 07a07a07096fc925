"""Where the client keeps its files: the sign-in in the user's config directory, and
the ssh files where the portal's ssh page says they go."""

from __future__ import annotations

import os
import pwd
import sys
import tempfile
from pathlib import Path


def home() -> Path:
    return Path(os.path.expanduser("~"))


def passwd_home() -> Path | None:
    """The home in the password database: where OpenSSH reads ``~/.ssh/config`` and
    expands ``~`` and a relative ``Include``, whatever ``$HOME`` says."""
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None


def ssh_reads_home() -> bool:
    """Whether plain ``ssh`` reads this home's ``~/.ssh`` (``$HOME`` is the home in the
    password database, or a link to it)."""
    other = passwd_home()
    try:
        return other is not None and os.path.samefile(other, home())
    except OSError:
        return False


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/tpu-portal`` or ``~/.config/tpu-portal`` on Linux;
    ``~/Library/Application Support/tpu-portal`` on macOS. ``TPU_PORTAL_CONFIG_DIR``
    overrides both."""
    chosen = os.environ.get("TPU_PORTAL_CONFIG_DIR")
    if chosen:
        return Path(chosen)
    if sys.platform == "darwin":
        return home() / "Library" / "Application Support" / "tpu-portal"
    base = os.environ.get("XDG_CONFIG_HOME") or str(home() / ".config")
    return Path(base) / "tpu-portal"


def cache_dir() -> Path:
    """What the client may throw away and make again (the workdir's file hashes):
    ``$XDG_CACHE_HOME/tpu-portal`` or ``~/.cache/tpu-portal`` on Linux;
    ``~/Library/Caches/tpu-portal`` on macOS. ``TPU_PORTAL_CACHE_DIR`` overrides both."""
    chosen = os.environ.get("TPU_PORTAL_CACHE_DIR")
    if chosen:
        return Path(chosen)
    if sys.platform == "darwin":
        return home() / "Library" / "Caches" / "tpu-portal"
    base = os.environ.get("XDG_CACHE_HOME") or str(home() / ".cache")
    return Path(base) / "tpu-portal"


def ssh_dir() -> Path:
    return home() / ".ssh"


def ssh_config_file() -> Path:
    """The portal's config: ``~/.ssh/config.d/tpu-portal``."""
    return ssh_dir() / "config.d" / "tpu-portal"


def known_hosts_file() -> Path:
    """The pinned host keys the config names: ``~/.ssh/tpu-portal_known_hosts``."""
    return ssh_dir() / "tpu-portal_known_hosts"


def private_dir(path: Path) -> Path:
    """``path`` made if missing, and readable by its owner only (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """``text`` into ``path`` at once (a temporary file renamed over it), ``mode``. A
    symlinked file (a dotfiles manager's) is written where it points, and stays a link."""
    target = path.resolve() if path.is_symlink() else path
    fd, tmp = tempfile.mkstemp(dir=str(target.parent), prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

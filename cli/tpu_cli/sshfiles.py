"""The ssh config and known_hosts where the portal's ssh page says they go
(``~/.ssh/config.d/tpu-portal``, ``~/.ssh/tpu-portal_known_hosts``), the ``Include``
line at the top of ``~/.ssh/config``, and what the config says about each VM's
workers (host names, addresses, the unix username)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpu_cli import paths, sshbuild
from tpu_cli.errors import UNREACHABLE, ApiError, CliError

_INCLUDE_RE = re.compile(r"^\s*include\s*[=\s]\s*(.*)$", re.IGNORECASE)
_BLOCK_RE = re.compile(r"^\s*(host|match)\b", re.IGNORECASE)
# The header line that carries the time the portal made the file: it changes at every
# download, so it does not count as a change.
_GENERATED = "# TPU Portal ssh config for "


@dataclass
class Refreshed:
    config_changed: bool
    known_hosts_changed: bool

    @property
    def changed(self) -> bool:
        return self.config_changed or self.known_hosts_changed


def _same(old: str, new: str) -> bool:
    def strip(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(_GENERATED)]

    return strip(old) == strip(new)


def _write_if_changed(path: Path, text: str) -> bool:
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = None
    if old is not None and _same(old, text):
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return False
    paths.write_private(path, text)
    return True


def refresh(api) -> Refreshed:
    """Both files written by the client from the portal's ``/me/ssh-hosts`` (every value
    checked, ``sshbuild``), and only when an address, a host key or a host changed;
    ``~/.ssh`` and ``~/.ssh/config.d`` are 0700, the files 0600. Nothing is written when
    the portal's answer is refused."""
    try:
        answer = api.get("/me/ssh-hosts")
    except ApiError as exc:
        if exc.status not in (404, 405):
            raise
        raise CliError(
            f"{api.url} does not describe your ssh hosts (/api/v1/me/ssh-hosts): the portal "
            "is older than this client. Ask its admins to update it.",
            UNREACHABLE,
        ) from None
    built = sshbuild.build(answer, api.url, paths.known_hosts_file())
    paths.private_dir(paths.ssh_dir())
    paths.private_dir(paths.ssh_config_file().parent)
    return Refreshed(
        _write_if_changed(paths.ssh_config_file(), built.config),
        _write_if_changed(paths.known_hosts_file(), built.known_hosts),
    )


def include_line() -> str:
    """``Include <home>/.ssh/config.d/*``, absolute: OpenSSH resolves a relative Include
    against the home in the password database, which ``$HOME`` may not be."""
    return f"Include {sshbuild.quoted(paths.ssh_config_file().parent / '*', tokens=False)}"


def _words(rest: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError:
        return rest.split()


def include_present(text: str) -> bool:
    """Whether ``~/.ssh/config`` (``text``) reads the portal's file before its first
    ``Host``/``Match`` block (an Include inside a block applies to that block only). A
    relative (or ``~``) Include counts only when ssh's home is this one."""
    folder = str(paths.ssh_config_file().parent)
    prefixes = [folder + "/"]
    if paths.ssh_reads_home():
        prefixes += ["~/.ssh/config.d/", "config.d/"]
    for line in text.splitlines():
        if _BLOCK_RE.match(line):
            return False
        found = _INCLUDE_RE.match(line)
        if found:
            for word in _words(found.group(1)):
                if any(word in (p + "*", p + "tpu-portal") for p in prefixes):
                    return True
    return False


def ensure_include() -> Path | None:
    """``include_line()`` at the top of ``~/.ssh/config``, once. Returns the backup of
    the file as it was when the line was added, else None (it was there, or there was
    no file)."""
    ssh = paths.private_dir(paths.ssh_dir())
    config = ssh / "config"
    try:
        text = config.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    if text is not None and include_present(text):
        return None
    backup = None
    if text is not None:
        backup = ssh / "config.tpu-portal-backup"
        if backup.exists():
            backup = ssh / f"config.tpu-portal-backup.{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.copy2(str(config.resolve()), str(backup))
        backup.chmod(0o600)
    body = f"{include_line()}\n" + (f"\n{text}" if text else "")
    paths.write_private(config, body)
    return backup


def include_installed() -> bool:
    try:
        return include_present((paths.ssh_dir() / "config").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False


# --- what the config says -------------------------------------------------------------


@dataclass
class SshVm:
    """One VM as the person's ssh config names it."""

    lab: str
    name: str
    zone: str | None
    main: str  # what the person types for worker 0: tpu5
    user: str = ""
    hosts: dict[int, str] = field(default_factory=dict)  # worker index -> host name
    addresses: dict[int, str] = field(default_factory=dict)  # worker index -> HostName

    def host(self, index: int) -> str:
        return self.hosts[index]


def parse_config(text: str) -> list[SshVm]:
    """The VMs in the portal's config, read from each block's ``HostKeyAlias``
    (``tpu-portal.<lab>.<name>[.<zone>].w<index>``)."""
    blocks: list[dict[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        key, value = key.lower(), value.strip()
        if key == "host":
            blocks.append({"host": value})
        elif blocks:
            blocks[-1].setdefault(key, value)
    vms: dict[str, SshVm] = {}
    for block in blocks:
        alias = block.get("hostkeyalias", "")
        found = re.match(r"^tpu-portal\.(.+)\.w(\d+)$", alias)
        if not found:
            continue
        prefix, index = found.group(1), int(found.group(2))
        parts = prefix.split(".")
        lab, name, zone = parts[0], parts[1] if len(parts) > 1 else "", None
        if len(parts) > 2:
            zone = parts[2]
        vm = vms.get(prefix)
        if vm is None:  # worker 0's main entry comes first
            vm = vms[prefix] = SshVm(lab=lab, name=name, zone=zone, main=block["host"])
            vm.user = block.get("user", "")
        host = block["host"]
        # A pod's worker is tpu5-w3; worker 0 is both tpu5 and tpu5-w0: keep the latter.
        if index not in vm.hosts or host == f"{vm.main}-w{index}":
            vm.hosts[index] = host
        vm.addresses[index] = block.get("hostname", "")
    return list(vms.values())


def read_config() -> list[SshVm]:
    try:
        return parse_config(paths.ssh_config_file().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []


def ssh_base() -> list[str]:
    """``ssh`` as the person's own: through ``~/.ssh/config`` when it includes the
    portal's file (``-F`` it when plain ssh reads another home's, ``$HOME`` not being the
    home in the password database), else with the portal's file alone (``tpu config
    install`` adds the Include)."""
    if include_installed():
        if paths.ssh_reads_home():
            return ["ssh"]
        return ["ssh", "-F", str(paths.ssh_dir() / "config")]
    return ["ssh", "-F", str(paths.ssh_config_file())]


def plain_ssh_finds(host: str, address: str) -> bool:
    """Whether plain ``ssh host`` (the person's ssh as they type it) goes to
    ``address``: its own config includes the portal's file."""
    try:
        found = subprocess.run(["ssh", "-G", host], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    options = dict(line.partition(" ")[::2] for line in found.stdout.splitlines())
    return found.returncode == 0 and options.get("hostname") == address

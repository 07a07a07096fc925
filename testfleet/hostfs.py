"""The files that make one fleet host: its /etc layer, host keys, admin account, homes.

A host's folder in the state dir holds everything the host owns::

    etc/ etc.work/   upper layer and overlay work dir over the machine's /etc
    var/ var.work/   the same for /var (lastlog, mail spools, logs stay per host)
    home/ root/      bind-mounted over /home and /root
    boot_id          bind-mounted over /proc/sys/kernel/random/boot_id
    sshd.log         sshd's own log (it runs with -e), read by tests
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

HOST_KEY_TYPES = ("ed25519", "ecdsa", "rsa")
# RSA host keys of 2048 bits: a 3072-bit key takes ~0.2 s of CPU to generate here, which
# would dominate starting 32 hosts; sshd and clients accept 2048 (the minimum is 1024).
RSA_BITS = 2048


@dataclass(frozen=True)
class AdminAccount:
    """The account the portal logs in as: passwordless sudo, the fleet's admin key."""

    name: str
    uid: int
    gid: int

    @classmethod
    def choose(cls, name: str = "admin") -> AdminAccount:
        """The first UID/GID from 1000 up that the machine does not use."""
        used_uids = {int(line.split(":")[2]) for line in _lines("/etc/passwd")}
        used_gids = {int(line.split(":")[2]) for line in _lines("/etc/group")}
        number = 1000
        while number in used_uids or number in used_gids:
            number += 1
        return cls(name, number, number)


def _lines(path: str) -> list[str]:
    return [line for line in Path(path).read_text().splitlines() if line.strip()]


def _append_to_copy(name: str, upper: Path, line: str) -> None:
    """upper/name = the machine's /etc/name plus ``line``, with the original's mode."""
    source = Path("/etc") / name
    target = upper / name
    lines = _lines(str(source))
    key = line.split(":")[0] + ":"
    lines = [existing for existing in lines if not existing.startswith(key)] + [line]
    target.write_text("\n".join(lines) + "\n")
    info = source.stat()
    os.chown(target, info.st_uid, info.st_gid)
    os.chmod(target, info.st_mode & 0o7777)


def _mkdir_like(path: Path, like: str) -> None:
    """Create an upper-layer folder with the same owner and mode as the machine's."""
    path.mkdir(parents=True, exist_ok=True)
    info = os.stat(like)
    os.chown(path, info.st_uid, info.st_gid)
    os.chmod(path, info.st_mode & 0o7777)


def prepare(
    host_dir: Path, hostname: str, ip: str, admin: AdminAccount, admin_public_key: str
) -> None:
    """Lay out a new host's folder (everything but host keys and the boot id)."""
    for sub in ("etc", "etc.work", "var", "var.work", "home"):
        (host_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(host_dir / sub, 0o755)  # noqa: S103 (the host sees these as /etc, /var, /home)
    (host_dir / "root").mkdir(mode=0o700, exist_ok=True)
    etc = host_dir / "etc"

    days = int(time.time() // 86400)
    _append_to_copy(
        "passwd", etc, f"{admin.name}:x:{admin.uid}:{admin.gid}::/home/{admin.name}:/bin/bash"
    )
    _append_to_copy("shadow", etc, f"{admin.name}:*:{days}:0:99999:7:::")
    _append_to_copy("group", etc, f"{admin.name}:x:{admin.gid}:")
    _append_to_copy("gshadow", etc, f"{admin.name}:!::")

    _mkdir_like(etc / "sudoers.d", "/etc/sudoers.d")
    sudoers = etc / "sudoers.d" / f"90-testfleet-{admin.name}"
    sudoers.write_text(f"{admin.name} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(sudoers, 0o440)

    # Debian's sshd_config as shipped (UsePAM yes), plus one line: VERBOSE logs every
    # connection ("Connection from …"), which the tests count.
    _mkdir_like(etc / "ssh", "/etc/ssh")
    _mkdir_like(etc / "ssh" / "sshd_config.d", "/etc/ssh/sshd_config.d")
    (etc / "ssh" / "sshd_config.d" / "testfleet.conf").write_text("LogLevel VERBOSE\n")

    (etc / "hostname").write_text(f"{hostname}\n")
    write_hosts(host_dir, hostname, ip)
    (etc / "machine-id").write_text(f"{uuid.uuid4().hex}\n")

    home = host_dir / "home" / admin.name
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    (ssh / "authorized_keys").write_text(admin_public_key.strip() + "\n")
    for path, mode in ((home, 0o750), (ssh, 0o700), (ssh / "authorized_keys", 0o600)):
        os.chown(path, admin.uid, admin.gid)
        os.chmod(path, mode)


def write_hosts(host_dir: Path, hostname: str, ip: str) -> None:
    """The host's /etc/hosts: its own name resolves to its fleet address, as a TPU VM's
    name resolves to its internal IP. Gloo (JAX's CPU collectives) announces whatever
    the host name resolves to, so with 127.0.1.1 a pod's first collective would hang.

    Written in place (not replaced), because the file may already be in the upper layer
    of the running host's /etc overlay, which then sees the new text at once."""
    lines = [ln for ln in _lines("/etc/hosts") if hostname not in ln.split()[1:]]
    text = f"{ip}\t{hostname}\n" + "\n".join(lines) + "\n"
    path = host_dir / "etc" / "hosts"
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o644)


def write_keypair(path: Path, key_type: str, comment: str) -> None:
    """Write an unencrypted OpenSSH private key at ``path`` and its ``.pub`` beside it.

    Generated in-process: OpenSSL releases the GIL, so threads use every core, and it
    is several times faster than running ssh-keygen for RSA."""
    if key_type == "ed25519":
        key = ed25519.Ed25519PrivateKey.generate()
    elif key_type == "ecdsa":
        key = ec.generate_private_key(ec.SECP256R1())
    elif key_type == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=RSA_BITS)
    else:
        raise ValueError(f"unknown key type {key_type!r}")
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    tmp.replace(path)
    path.with_name(path.name + ".pub").write_bytes(public + f" {comment}\n".encode())


def generate_host_key(host_dir: Path, key_type: str, hostname: str) -> None:
    """Write a fresh ``ssh_host_<type>_key`` into the host's /etc/ssh layer."""
    ssh = host_dir / "etc" / "ssh"
    _mkdir_like(ssh, "/etc/ssh")
    write_keypair(ssh / f"ssh_host_{key_type}_key", key_type, f"root@{hostname}")


def host_keys(host_dir: Path) -> list[str]:
    """The host's public host keys as ``"<type> <base64>"`` strings, ed25519 first."""
    keys = []
    for key_type in HOST_KEY_TYPES:
        path = host_dir / "etc" / "ssh" / f"ssh_host_{key_type}_key.pub"
        key_kind, blob = path.read_text().split()[:2]
        keys.append(f"{key_kind} {blob}")
    return keys


def new_boot_id(host_dir: Path) -> str:
    boot_id = str(uuid.uuid4())
    path = host_dir / "boot_id"
    tmp = path.with_name("boot_id.new")
    tmp.write_text(boot_id + "\n")
    os.chmod(tmp, 0o444)
    tmp.replace(path)
    return boot_id


def remove(host_dir: Path) -> None:
    shutil.rmtree(host_dir, ignore_errors=True)

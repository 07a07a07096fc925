"""What may reach a worker: the one home of each validation fact that both the portal's
forms and models and the last check before a root shell (``desired.encode``) use.

Plain Python, no Django: ``tpus/remote`` encodes for the hosts without the web app,
and ``accounts`` and ``tpus.models`` import these facts from here rather than keeping
copies that drift. The facts live next to the door to the hosts because the hosts are
what they protect; ``scripts/reconcile/10-input.sh`` states them once more in shell
(it cannot import Python), and ``tpus/tests/test_validation_rules_on_hosts.py``
runs that part of the script on a fleet host with cases generated from this module,
so the two accept and refuse exactly the same values.

The portal may add policy on top (reserved usernames, no trailing hyphen: see
``accounts/usernames.py``); it never accepts what these rules refuse.
"""

from __future__ import annotations

import re

# SSH public key types a collaborator may use; order matters only for messages (the
# best choice first). DSA is gone from OpenSSH; RSA keys are held to a minimum size
# by accounts/sshkeys.py.
KEY_TYPES: tuple[str, ...] = (
    "ssh-ed25519",
    "sk-ssh-ed25519@openssh.com",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "ssh-rsa",
)

# The portable core of a unix username (POSIX portable filename characters, lower
# case, starting with a letter, at most 31 characters).
USERNAME_MAX_LENGTH = 31
USERNAME = re.compile(r"[a-z][a-z0-9-]{0,30}")

# Google's device names: lower-case letters, digits and hyphens, starting with a
# letter, not ending with a hyphen; the disk is /dev/disk/by-id/google-<device>.
DEVICE = re.compile(r"[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?")

# A mount point: absolute, parts of these characters, no '.' or '..' part, no empty
# or trailing part.
MOUNT_POINT_PART = re.compile(r"[A-Za-z0-9._-]+")
MOUNT_POINT_MAX_LENGTH = 255
# Never at or under these: the system's own folders (mounting over them breaks or
# hides the system), places where someone else can write and plant a symlink for
# root's mkdir (/home, /tmp, /var/tmp, /run), and /srv, whose contents services on
# the VM publish (a disk mounted there would replace what a web or file server
# serves). /mnt/disks/<name> or /ssd is the usual choice.
FORBIDDEN_MOUNT_TREES: tuple[str, ...] = (
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
    "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var",  # noqa: S108
)  # fmt: skip


def is_username(value: object) -> bool:
    return isinstance(value, str) and USERNAME.fullmatch(value) is not None


def is_device(value: object) -> bool:
    return isinstance(value, str) and DEVICE.fullmatch(value) is not None


def mount_point_problem(value: object) -> str | None:
    """Why ``value`` cannot be a mount point, or None when it can."""
    if not isinstance(value, str) or not value.startswith("/"):
        return "A mount point is an absolute path, like /mnt/disks/data."
    if len(value) > MOUNT_POINT_MAX_LENGTH:
        return f"A mount point is at most {MOUNT_POINT_MAX_LENGTH} characters long."
    parts = value[1:].split("/")
    if any(part in (".", "..") for part in parts):
        return "A mount point has no . or .. in it."
    if not all(MOUNT_POINT_PART.fullmatch(part) for part in parts):
        return (
            "A mount point is an absolute path of letters, digits, dots, hyphens and "
            "underscores, without an empty or trailing part."
        )
    for tree in FORBIDDEN_MOUNT_TREES:
        if value == tree or value.startswith(tree + "/"):
            return f"{value} is a system directory; use something like /ssd or /mnt/data."
    return None

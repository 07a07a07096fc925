"""UID and GID ranges that other parts of a TPU VM hand out, so the portal's own range
(``PORTAL_UID_MIN``..``PORTAL_UID_MAX``) never meets them.

On a worker, accounts appear that the portal did not make: Google's guest agent runs
``useradd`` for every ``ssh-keys`` entry (for instance after ``gcloud … tpu-vm ssh``),
packages add system accounts, systemd allocates users on the fly, and rootless
containers map subordinate ids. Any of them taking a number the portal gives next
would make that person's grant fail on that worker. The default range, 70000..99999,
lies between all of them: above 65535 (no 16-bit tool confusion), below the
subordinate ids, and room for 30,000 people.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

RESERVED = (
    (0, 999, "system accounts (SYS_UID_MIN..SYS_UID_MAX)"),
    (1000, 60000, "Debian's useradd and adduser for ordinary accounts (UID_MIN..UID_MAX in "
     "/etc/login.defs), which Google's guest agent uses for ssh-keys users"),
    (60001, 60513, "systemd-homed users"),
    (60514, 61183, "systemd's container and foreign-user mappings"),
    (61184, 65519, "systemd dynamic users (DynamicUser=)"),
    (65520, 65535, "nobody, nogroup and the 16-bit -1"),
    (100000, 600100000, "subordinate ids for rootless containers (SUB_UID_MIN..SUB_UID_MAX)"),
    (524288, 1879048191, "systemd-nspawn container ranges"),
)  # fmt: skip

DEFAULT_MIN, DEFAULT_MAX = 70000, 99999


def clashes(first: int, last: int) -> list[str]:
    """What ``first..last`` (inclusive) overlaps, as descriptions."""
    return [
        f"{low}..{high}: {what}" for low, high, what in RESERVED if first <= high and low <= last
    ]


def check_uid_range(first: int, last: int) -> None:
    """Refuse, at start-up, a range that another part of the host hands out."""
    found = clashes(first, last)
    if found:
        raise ImproperlyConfigured(
            f"PORTAL_UID_MIN..PORTAL_UID_MAX ({first}..{last}) overlaps UIDs that others "
            f"hand out on the workers: {'; '.join(found)}. Choose a range inside "
            f"{DEFAULT_MIN}..{DEFAULT_MAX} (the default) or elsewhere outside these."
        )

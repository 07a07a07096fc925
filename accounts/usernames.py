"""Unix usernames: the rules, the one reserved list, and suggestions from key comments.

A collaborator's username becomes a real account (and a group of the same name) on
every worker of every TPU VM they use, so it must be portable (``^[a-z][a-z0-9-]{0,30}$``)
and must never collide with an account or group that the OS image, a package or the
portal itself relies on. Uniqueness ignoring case is the database's job; ``normalise``
gives the form to compare.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

from tpus.remote import rules

# The hosts' rule (tpus/remote/rules.py); the checks below add the portal's policy.
MAX_LENGTH = rules.USERNAME_MAX_LENGTH
USERNAME_RE = rules.USERNAME

# The user and group names that Debian's packages create, generated from the packages
# themselves by bin/reserved-names (see accounts/reserved_names.py): base-passwd's
# master files, sysusers.d files and the maintainer scripts' adduser/addgroup/useradd/
# groupadd commands. First field of each line; '#' lines are its header.
PACKAGE_NAMES_FILE = Path(__file__).resolve().parent / "data" / "reserved-usernames.txt"


def _package_names(path: Path = PACKAGE_NAMES_FILE) -> frozenset[str]:
    with path.open(encoding="ascii") as lines:
        return frozenset(
            line.split("\t", 1)[0].strip().lower()
            for line in lines
            if line.strip() and not line.startswith("#")
        )


# One list for everything a person may not be called. A name here is refused as a
# username whether it is a user or a group on the hosts, because every portal user
# also gets a group of that name. Debian's packages give most of it (above); these
# come from elsewhere.
RESERVED_USERNAMES: frozenset[str] = _package_names() | frozenset(
    # Older Debian releases, Ubuntu-only packages, other distributions' names for the
    # same services, and snaps and vendor installers (microk8s, ollama) that are not
    # Debian packages at all, which TPU VM images (Ubuntu) and labs use.
    "gnats ssh syslog landscape pollinate rdma chrony ntp rpc rpcuser rpcbind nfsnobody "
    "dbus cups sambashare gdm whoopsie kernoops snap snapd snap_daemon lxd-agent qemu "
    "containerd podman wheel mlocate lastlog cloud-init microk8s ollama "
    # Default accounts of cloud images, and Google's guest environment.
    "ubuntu admin debian ec2-user centos fedora cloud-user rocky almalinux opc azureuser "
    "core alpine arch bitnami google-sudoers google-guest-agent google cloudsdk "
    # Services a lab is likely to run on a VM or next to the portal.
    "mariadb memcached mongodb elasticsearch nginx apache apache2 httpd www web http "
    "https ftp git gitlab jenkins exim named node nodejs jupyter grafana "
    "nvidia-persistenced celery "
    # Names that read as authority or would confuse people and scripts.
    "administrator superuser toor sysadmin system guest "
    "portal tpu-portal tpuportal support security abuse postmaster hostmaster webmaster "
    "info".split()
)
# Whole families: systemd creates systemd-* users and groups on demand, names starting
# with "_" are the Debian convention for system accounts, and "tpu-portal" names are
# the portal's own on the workers (its service account, its group tpu-portal-users).
RESERVED_PREFIXES: tuple[str, ...] = ("systemd-", "_", "google-", "tpu-portal")


def admin_account_names() -> set[str]:
    """The account(s) the portal itself logs in as on the hosts. Read at call time so
    a settings change (or a test override) takes effect."""
    name = getattr(settings, "PORTAL_ADMIN_SSH_USER", "admin")
    names = [name] if isinstance(name, str) else list(name)
    return {normalise(n) for n in names if n}


def normalise(name: str) -> str:
    """The form two usernames are compared in: surrounding space removed, ASCII
    letters lowercased. Valid usernames are ASCII, so this is all case-insensitive
    uniqueness needs."""
    return "".join(c.lower() if c.isascii() else c for c in name.strip())


def is_reserved(name: str, extra_reserved: Iterable[str] = ()) -> bool:
    key = normalise(name)
    if key in RESERVED_USERNAMES or key.startswith(RESERVED_PREFIXES):
        return True
    return key in admin_account_names() or key in {normalise(n) for n in extra_reserved}


def validate_unix_username(name: str, extra_reserved: Iterable[str] = ()) -> None:
    """Raise ``ValidationError`` with a specific code when ``name`` cannot be a unix
    username on the lab's machines. Codes: ``required``, ``machine_account``,
    ``uppercase``, ``start_letter``, ``invalid_character``, ``too_long``,
    ``trailing_hyphen``, ``reserved``."""
    if not name:
        raise ValidationError("Choose a username.", code="required")
    if name.endswith("$"):
        raise ValidationError(
            "Names ending in $ are reserved for machine accounts. Choose a name without it.",
            code="machine_account",
        )
    lowered = "".join(c.lower() if c.isascii() else c for c in name)
    if lowered != name:
        if _follows_rules(lowered):
            raise ValidationError(
                "Unix usernames are lowercase. Try “%(suggestion)s”.",
                code="uppercase",
                params={"suggestion": lowered},
            )
        raise ValidationError("Unix usernames are lowercase.", code="uppercase")
    if not ("a" <= name[0] <= "z"):
        raise ValidationError(
            "A username must start with a lowercase letter (a–z), not %(char)s.",
            code="start_letter",
            params={"char": _describe(name[0])},
        )
    bad = next(
        (c for c in name if not (c.isascii() and (c.islower() or c.isdigit() or c == "-"))), None
    )
    if bad is not None:
        hint = " Use a hyphen instead." if bad in "._ " else ""
        raise ValidationError(
            "A username may contain only lowercase letters, digits and hyphens, "
            "not %(char)s." + hint,
            code="invalid_character",
            params={"char": _describe(bad)},
        )
    if len(name) > MAX_LENGTH:
        raise ValidationError(
            "A username can be at most %(max)d characters long (this one has %(length)d).",
            code="too_long",
            params={"max": MAX_LENGTH, "length": len(name)},
        )
    # POSIX allows it, but a trailing hyphen is nearly always a typo and makes
    # names like "milo-" and "milo" look identical in lists.
    if name.endswith("-"):
        raise ValidationError("A username cannot end with a hyphen.", code="trailing_hyphen")
    if is_reserved(name, extra_reserved):
        raise ValidationError(
            "“%(name)s” is used by the system or the portal. Choose another username.",
            code="reserved",
            params={"name": name},
        )


def _follows_rules(name: str) -> bool:
    return bool(USERNAME_RE.fullmatch(name)) and not name.endswith("-")


def _describe(char: str) -> str:
    """A character, named so that invisible ones can still be seen in a message."""
    if char == " ":
        return "a space"
    if "!" <= char <= "~":
        return f"“{char}”"
    return f"U+{ord(char):04X}"


# Comments that key generators write by default say nothing about the person.
_GENERATED_COMMENT = re.compile(r"(rsa|dsa|ecdsa|ed25519|eddsa)-key-\d{8}|imported-openssh-key")


def suggest_username(comment: str, extra_reserved: Iterable[str] = ()) -> str | None:
    """A username suggested from an SSH key comment, or None if nothing sensible can
    be made. ``milo@laptop`` → ``milo``; ``Milo.Smith@MacBook`` → ``milo-smith``;
    ``CORP\\José@pc`` → ``jose``. The part before ``@`` (after any Windows domain) is
    folded to ASCII and lowercased, and runs of other characters become one hyphen.
    A reserved result (``root@box``) gets the first free digit appended
    (``root2``); if none works, or the result is a reserved family
    (``systemd-…``), there is no suggestion."""
    text = comment.strip()
    if not text or _GENERATED_COMMENT.fullmatch(text.lower()):
        return None
    local = text.split("@", 1)[0] if "@" in text else text.split()[0]
    local = local.rsplit("\\", 1)[-1]
    ascii_text = unicodedata.normalize("NFKD", local).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower())
    slug = slug.lstrip("-0123456789")[:MAX_LENGTH].rstrip("-")
    if not slug:
        return None
    candidates = [slug] + [f"{slug[: MAX_LENGTH - 1].rstrip('-')}{n}" for n in range(2, 10)]
    for candidate in candidates:
        try:
            validate_unix_username(candidate, extra_reserved)
        except ValidationError:
            continue
        return candidate
    return None

"""The hosts refuse exactly what the portal refuses: cases generated from
tpus/remote/rules.py (usernames, key types, devices, mount points) are fed to
reconcile.sh's own input checks (its first two parts, as shipped) on a fleet host,
and each verdict must equal the Python one."""

from __future__ import annotations

import base64
import string

import pytest
from django.core.exceptions import ValidationError

from accounts import sshkeys
from accounts import usernames as username_rules
from tpus.models.inventory import validate_mount_point
from tpus.remote import desired, rules, scripts

# Every printable character but the space (a space separates fields in the format).
CHARACTERS = [c for c in string.printable if c not in string.whitespace]
UID = 30001
HEADER = [desired.HEADER, "range 30000 59999"]


def usernames() -> list[str]:
    top = "a" * rules.USERNAME_MAX_LENGTH
    cases = ["a", "milo", "milo-", "a1", top, top + "a", "1a", "-a", "A", "mIlo"]
    cases += [f"a{c}" for c in CHARACTERS] + [f"{c}a" for c in CHARACTERS]
    return sorted(set(cases))


def key_types() -> list[str]:
    near = ["ssh-dss", "ssh-ed448", "ecdsa-sha2-nistp224", "ssh-rsa-cert-v01@openssh.com",
            "SSH-RSA", "sk-ssh-ed25519", "rsa-sha2-512", "ssh-ed25519x"]  # fmt: skip
    return [*rules.KEY_TYPES, *near]


def devices() -> list[str]:
    cases = ["d", "persistent-disk-1", "disk-", "-disk", "1disk", "a" * 63, "a" * 64, "Disk"]
    cases += [f"d{c}d" for c in CHARACTERS]
    return sorted(set(cases))


def mount_points() -> list[str]:
    cases = ["/ssd", "/mnt/disks/data", "/mnt/a.b", "/mnt/...", "/mnt/.hidden", "/", "//",
             "/mnt//a", "/mnt/", "/mnt/.", "/mnt/..", "/mnt/./a", "/mnt/../etc", "mnt",
             "/" + "a" * 254, "/" + "a" * 255, "/mnt/" + "b" * 250]  # fmt: skip
    for tree in rules.FORBIDDEN_MOUNT_TREES:
        cases += [tree, f"{tree}/", f"{tree}/x", f"{tree}x", f"/data{tree}"]
    cases += [f"/mnt/a{c}b" for c in CHARACTERS]
    return sorted(set(cases))


def key_line(key_type: str) -> str:
    # The script checks the shape of the data, not what it holds; the encoder's
    # inner-type check is a Python-only extra the tests of desired.py cover.
    blob = base64.b64encode(b"\0\0\0\x0bssh-ed25519" + b"\1" * 36).decode()
    return f"key milo {key_type} {blob} milo@laptop"


def cases() -> list[tuple[str, str, bool]]:
    """(what, input text, the Python verdict) for every generated value."""
    out = []
    for name in usernames():
        lines = [*HEADER, f"user {name} {UID} 1 0", "end"]
        out.append((f"username {name!r}", "\n".join(lines) + "\n", rules.is_username(name)))
    for key_type in key_types():
        lines = [*HEADER, f"user milo {UID} 1 0", key_line(key_type), "end"]
        verdict = key_type in rules.KEY_TYPES
        out.append((f"key type {key_type!r}", "\n".join(lines) + "\n", verdict))
    for device in devices():
        lines = [*HEADER, f"mount {device} /mnt/disks/data ro", "end"]
        out.append((f"device {device!r}", "\n".join(lines) + "\n", rules.is_device(device)))
    for point in mount_points():
        lines = [*HEADER, f"mount disk-1 {point} ro", "end"]
        verdict = rules.mount_point_problem(point) is None
        out.append((f"mount point {point!r}", "\n".join(lines) + "\n", verdict))
    return out


# Runs the check (its first argument) once per case: each case arrives as one line of
# base64 on stdin, and the answer is one line "1" (accepted) or "0" (refused).
DRIVER = """set -eu
check=$1
case_file=$(mktemp)
while IFS= read -r line; do
    printf '%s' "$line" | base64 -d >"$case_file"
    if sh -c "$check" reconcile-input <"$case_file" >/dev/null 2>&1; then echo 1; else echo 0; fi
done
rm -f "$case_file"
"""


def the_scripts_input_checks() -> str:
    """reconcile.sh's own parts up to its input checks, as shipped, then a line that
    says the input passed. The lock and everything that changes the host come after
    these parts, so nothing on the host changes."""
    parts = scripts.parts("reconcile.sh")
    names = [p.name for p in parts]
    checks = parts[: names.index("10-input.sh") + 1]
    return "".join(p.read_text() for p in checks) + 'echo "input accepted"\n'


def test_the_python_rules_agree_with_the_encoder():
    """The encoder (the last Python check before a host) uses the same rules."""
    for name in usernames():
        assert rules.is_username(name) == _accepts(desired.check_username, name), name
    for device in devices():
        assert rules.is_device(device) == _accepts(desired.check_device, device), device
    for point in mount_points():
        ok = rules.mount_point_problem(point) is None
        assert ok == _accepts(desired.check_mount_point, point), point


@pytest.mark.fleet
def test_reconcile_sh_accepts_and_refuses_exactly_what_the_portal_does(fleet, fleet_host):
    generated = cases()
    stdin = "\n".join(base64.b64encode(text.encode()).decode() for _, text, _ in generated)
    done = fleet.exec(
        fleet_host.name,
        ["sh", "-c", DRIVER, "driver", the_scripts_input_checks()],
        input=(stdin + "\n").encode(),
        timeout=300,
    )
    answers = done.stdout.decode().split()
    assert len(answers) == len(generated)
    disagreements = [
        f"{what}: Python {'accepts' if ok else 'refuses'}, the script "
        f"{'accepts' if answer == '1' else 'refuses'}"
        for (what, _, ok), answer in zip(generated, answers, strict=True)
        if (answer == "1") != ok
    ]
    assert not disagreements, "\n".join(disagreements)
    # Both sides do refuse things: the cases are not all alike.
    assert "0" in answers and "1" in answers


def test_the_portal_and_the_encoder_use_one_list_of_key_types_and_one_username_rule():
    assert sshkeys.ALLOWED_KEY_TYPES is rules.KEY_TYPES is desired.KEY_TYPES
    assert username_rules.USERNAME_RE is rules.USERNAME
    assert username_rules.MAX_LENGTH == rules.USERNAME_MAX_LENGTH


def test_a_disks_mount_point_form_field_follows_the_hosts_rule():
    """The model's validator refuses exactly what the encoder refuses, /srv included."""
    for point in mount_points():
        try:
            validate_mount_point(point)
        except ValidationError:
            ok = False
        else:
            ok = True
        assert ok == (rules.mount_point_problem(point) is None), point
    assert not _accepts(desired.check_mount_point, "/srv/data")


def _accepts(check, value) -> bool:
    try:
        check(value)
    except ValueError:
        return False
    return True


def _verdict(fleet, host, lines: list[str]) -> str:
    """'accepted', or the reason the script's input checks gave."""
    done = fleet.exec(
        host.name,
        ["sh", "-c", the_scripts_input_checks(), "reconcile-input"],
        input=("\n".join(lines) + "\n").encode(),
        check=False,
    )
    if done.returncode == 0:
        return "accepted"
    return done.stderr.decode().strip().splitlines()[-1].removeprefix("reconcile: ")


@pytest.mark.fleet
def test_each_fields_longest_length_and_the_first_bad_line_is_named(fleet, fleet_host):
    blob = base64.b64encode(b"\0\0\0\x0bssh-ed25519" + b"\1" * 36).decode()
    user = f"user milo {UID} 1 0"

    def key(comment: str) -> str:
        return f"key milo ssh-ed25519 {blob} {comment}"

    refused = "line {} of the input is not a valid record; nothing was changed"
    cases = [
        ([*HEADER, f"user {'a' * 31} {UID} 1 0", "end"], "accepted"),
        ([*HEADER, f"user {'a' * 32} {UID} 1 0", "end"], refused.format(3)),
        ([desired.HEADER, "range 1000 2000000000", "end"], "accepted"),
        ([desired.HEADER, "range 1000 10000000000", "end"], refused.format(2)),
        ([*HEADER, f"version {'s' * 64} {'9' * 18}", "end"], "accepted"),
        ([*HEADER, f"version {'s' * 65} 1", "end"], refused.format(3)),
        ([*HEADER, f"version s {'9' * 19}", "end"], refused.format(3)),
        ([*HEADER, user, key("c" * 100), "end"], "accepted"),
        ([*HEADER, user, key("c" * 101), "end"], refused.format(4)),
        ([*HEADER, f"mount {'d' * 63} /data ro", "end"], "accepted"),
        ([*HEADER, f"mount {'d' * 64} /data ro", "end"], refused.format(3)),
        # The first line found wanting is named, whichever check found it.
        ([*HEADER, f"user {'a' * 32} {UID} 1 0", "bogus", "end"], refused.format(3)),
        ([*HEADER, "bogus", f"user {'a' * 32} {UID} 1 0", "end"], refused.format(3)),
        ([*HEADER, user, "key milo ssh-ed25519 !!", key("c" * 101), "end"], refused.format(4)),
    ]
    verdicts = [_verdict(fleet, fleet_host, lines) for lines, _ in cases]
    assert verdicts == [want for _, want in cases]

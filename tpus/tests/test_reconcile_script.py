"""reconcile.sh on real sshd hosts of the test fleet, driven through the remote door."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from tpus.remote import HostKeyPins, RemoteError, Worker, run_script, site_login
from tpus.remote.desired import DesiredMount, DesiredState, DesiredUser, encode

pytestmark = pytest.mark.fleet

UID_MIN, UID_MAX = 30000, 59999
_uids = itertools.count(UID_MIN + 100)
_names = itertools.count(1)
KEYS_DIR = "/etc/ssh/tpu-portal-keys"


# --- helpers ------------------------------------------------------------------------


def new_name() -> str:
    return f"rc{next(_names)}x{secrets.token_hex(3)}"


def state(*users: DesiredUser, mounts: tuple[DesiredMount, ...] = ()) -> DesiredState:
    return DesiredState(users=users, mounts=mounts, uid_min=UID_MIN, uid_max=UID_MAX)


def user(name: str, uid: int, *keys: str, active=True, sudo=False) -> DesiredUser:
    return DesiredUser(name, uid, active, sudo, tuple(keys))


class Target:
    """One fleet host as a worker to reconcile, with ways to look inside it and to log
    in as a collaborator with the real ssh client."""

    def __init__(self, fleet, host, tmp_path: Path):
        self.fleet = fleet
        self.host = host
        self.dir = tmp_path
        self.known_hosts = tmp_path / "known_hosts"
        self.known_hosts.write_text(
            "".join(f"{host.ip} {key}\n" for key in fleet.host_keys(host.name))
        )

    def reconcile(self, desired: DesiredState | bytes):
        data = desired if isinstance(desired, bytes) else encode(desired)
        pins = HostKeyPins.parse(self.fleet.host_keys(self.host.name))
        worker = Worker(self.host.ip, pins, name=self.host.name, login=site_login())
        return run_script(worker, "reconcile.sh", data)

    def sh(self, script: str, *, check: bool = True, input: bytes | None = None) -> str:
        """Run a shell snippet as root inside the host (``input`` on its stdin); its stdout."""
        done = self.fleet.exec(self.host.name, ["sh", "-c", script], check=check, input=input)
        return done.stdout.decode()

    def as_user(self, uid: int, script: str) -> None:
        """Run a shell snippet in the collaborator's home as them (no login, no PAM)."""
        self.fleet.exec(
            self.host.name,
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             "sh", "-c", f"cd /home/$(id -un) && {script}"],
        )  # fmt: skip

    def new_key(self, label: str) -> tuple[Path, str]:
        """A fresh ed25519 key pair: the private key file and ``type base64 comment``."""
        path = self.dir / f"id_{label}"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{label}@laptop",
             "-f", str(path)],
            check=True,
        )  # fmt: skip
        return path, path.with_suffix(".pub").read_text().strip()

    def ssh(self, user: str, key: Path, command: str = "true") -> subprocess.CompletedProcess:
        """Plain ssh as ``user`` with ``key``, the host key checked against its pins."""
        return subprocess.run(
            ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes",
             "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
             f"{user}@{self.host.ip}", command],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def live_processes(self, uid: int) -> list[str]:
        """The user's processes that still run (zombies waiting to be reaped do not)."""
        return self.sh(f"ps -e -o pid=,ruid=,stat= | awk '$2 == {uid} && $3 !~ /^Z/'").split("\n")[
            :-1
        ]

    def snapshot(self) -> str:
        """Every file and folder of /etc and /home with type, mode, owner, size, mtime
        and, for the account databases, content: any change shows."""
        return self.sh(
            "find /etc /home -xdev -printf '%p %y %m %u %g %s %T@ %l\\n' | sort; "
            "sha256sum /etc/passwd /etc/shadow /etc/group /etc/gshadow /etc/fstab"
        )

    def shadow(self, name: str) -> list[str]:
        return self.sh(f"getent shadow {name}").strip().split(":")

    def fstab_lines(self) -> list[str]:
        return [ln for ln in self.sh("cat /etc/fstab").splitlines() if "tpu-portal" in ln]


@pytest.fixture
def target(fleet, fleet_settings, fleet_host, tmp_path) -> Target:
    return Target(fleet, fleet_host, tmp_path)


# --- accounts and keys --------------------------------------------------------------


def test_a_new_user_logs_in_with_plain_ssh_into_a_proper_account(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("milo")

    result = target.reconcile(state(user(name, uid, public)))

    assert result.values["users_created"] == "1"
    assert result.values["keys_written"] == "1"
    assert result.values["boot_id"] == target.host.boot_id
    login = target.ssh(name, key, 'id -u; id -g; echo "$SHELL"; pwd')
    assert login.returncode == 0, login.stderr
    assert login.stdout.split() == [str(uid), str(uid), "/bin/bash", f"/home/{name}"]
    assert target.sh(f"getent passwd {name}").strip() == (
        f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash"
    )
    assert target.sh(f"getent group {name}").startswith(f"{name}:x:{uid}:")
    assert target.sh(f"getent gshadow {name}").startswith(f"{name}:!:")
    fields = target.shadow(name)
    assert fields[1] == "*" and fields[7] == ""  # no password, never expires
    home = target.sh(f"stat -c '%u %g %F' /home/{name}").strip()
    assert home == f"{uid} {uid} directory"
    # The key sits in root's folder, not in the home the collaborator controls.
    assert target.sh(f"stat -c '%a %U %G' {KEYS_DIR}/{name} {KEYS_DIR}").split("\n")[:2] == [
        "644 root root",
        "755 root root",
    ]
    assert target.sh(f"cat {KEYS_DIR}/{name}") == public + "\n"
    assert target.sh(f"ls -A /home/{name}/.ssh 2>/dev/null; true") == ""


def test_running_it_twice_changes_nothing_the_second_time(target):
    name, uid = new_name(), next(_uids)
    desired = state(user(name, uid, target.new_key("a")[1], sudo=True))
    first = target.reconcile(desired)
    assert int(first.values["changed"]) > 0 and "noop" not in first.values
    before = target.snapshot()

    second = target.reconcile(desired)

    assert second.values["changed"] == "0"
    assert second.values["noop"] == "1"
    assert target.snapshot() == before


def test_only_the_portals_current_keys_log_in(target):
    name, uid = new_name(), next(_uids)
    old_key, old_public = target.new_key("old")
    new_key, new_public = target.new_key("new")
    target.reconcile(state(user(name, uid, old_public)))
    assert target.ssh(name, old_key).returncode == 0

    result = target.reconcile(state(user(name, uid, new_public)))

    assert result.values["keys_written"] == "1"
    assert target.ssh(name, new_key).returncode == 0
    assert target.ssh(name, old_key).returncode == 255


def test_sudo_on_lets_the_user_sudo_and_sudo_off_removes_the_file(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("s")
    sudoers = f"/etc/sudoers.d/tpu-portal-{name}"
    target.reconcile(state())  # no other test's sudoers files on this host to remove

    on = target.reconcile(state(user(name, uid, public, sudo=True)))

    assert on.values["sudo_files"] == "1"
    assert target.sh(f"stat -c '%a %U %G' {sudoers}").strip() == "440 root root"
    assert target.sh(f"cat {sudoers}") == f"{name} ALL=(ALL:ALL) NOPASSWD:ALL\n"
    assert target.ssh(name, key, "sudo -n true").returncode == 0

    off = target.reconcile(state(user(name, uid, public, sudo=False)))

    assert off.values["sudo_files"] == "1"
    assert target.sh(f"test -e {sudoers} && echo there; true") == ""
    denied = target.ssh(name, key, "sudo -n true")
    assert denied.returncode != 0 and "password is required" in denied.stderr


def test_portal_files_changed_by_hand_are_put_back_even_at_the_same_size(target):
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("hand")
    sudoers = f"/etc/sudoers.d/tpu-portal-{name}"
    desired = state(user(name, uid, public, sudo=True))
    target.reconcile(desired)
    keys = target.sh(f"cat {KEYS_DIR}/{name}")
    # Same sizes, other bytes: only the content tells them apart.
    target.sh(f"sed -i 's/@laptop/@laptoq/' {KEYS_DIR}/{name}; sed -i 's/ALL$/ALX/' {sudoers}")

    result = target.reconcile(desired)

    assert (result.values["keys_written"], result.values["sudo_files"]) == ("1", "1")
    assert target.sh(f"cat {KEYS_DIR}/{name}") == keys
    assert target.sh(f"cat {sudoers}") == f"{name} ALL=(ALL:ALL) NOPASSWD:ALL\n"
    target.sh(f"chmod 600 {KEYS_DIR}/{name}")
    assert target.reconcile(desired).values["keys_written"] == "1"
    assert target.sh(f"stat -c %a {KEYS_DIR}/{name}").strip() == "644"
    assert target.reconcile(desired).values["noop"] == "1"


def test_a_keys_folder_opened_up_by_hand_is_closed_and_leftovers_are_removed(target):
    name, uid = new_name(), next(_uids)
    desired = state(user(name, uid, target.new_key("dir")[1]))
    target.reconcile(desired)
    # Someone loosened the folder, and a run killed mid-write left its temporary file.
    target.sh(f"chown {uid}:{uid} {KEYS_DIR}; chmod 0777 {KEYS_DIR}; "
              f"echo junk > {KEYS_DIR}/.tpu-portal.4242")  # fmt: skip

    result = target.reconcile(desired)

    assert result.values["keys_removed"] == "1"
    assert target.sh(f"stat -c '%a %U %G' {KEYS_DIR}").strip() == "755 root root"
    assert target.sh(f"ls -A {KEYS_DIR}").split().count(".tpu-portal.4242") == 0
    assert target.reconcile(desired).values["noop"] == "1"


# --- revoke -------------------------------------------------------------------------


def test_revoke_locks_the_user_out_kills_their_processes_and_keeps_their_home(target):
    name, uid = new_name(), next(_uids)
    portal_key, public = target.new_key("portal")
    own_key, own_public = target.new_key("own")
    target.reconcile(state(user(name, uid, public, sudo=True)))
    # A key the collaborator adds by hand opens nothing; the portal's does.
    target.as_user(
        uid,
        f"mkdir -m 700 .ssh && echo '{own_public}' > .ssh/authorized_keys && echo data > out",
    )
    assert target.ssh(name, own_key).returncode == 255
    assert target.ssh(name, portal_key).returncode == 0
    target.as_user(uid, "sleep 1000 </dev/null >/dev/null 2>&1 &")
    target.as_user(uid, "setsid sleep 1001 </dev/null >/dev/null 2>&1 &")
    assert len(target.live_processes(uid)) == 2

    result = target.reconcile(state(user(name, uid, public, active=False)))

    assert result.values["revoked"] == "1"
    assert result.values["processes_killed"] == "2"
    assert target.live_processes(uid) == []
    for key in (portal_key, own_key):
        refused = target.ssh(name, key, "echo in")
        assert refused.returncode == 255 and "in" not in refused.stdout.split()
    fields = target.shadow(name)
    assert fields[1] == "!*" and fields[7] == "1"  # locked and expired
    gone = target.sh(f"ls {KEYS_DIR}/{name} /etc/sudoers.d/tpu-portal-{name} 2>&1; true")
    assert gone.count("No such file") == 2
    # The home and everything in it stay, owned by the user.
    assert target.sh(f"cat /home/{name}/out") == "data\n"
    assert target.sh(f"stat -c %u /home/{name}").strip() == str(uid)
    # And revoking again is a no-op.
    again = target.reconcile(state(user(name, uid, public, active=False)))
    assert again.values["noop"] == "1"


def test_a_revoked_user_can_be_granted_access_again(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("back")
    target.reconcile(state(user(name, uid, public)))
    target.reconcile(state(user(name, uid, public, active=False)))
    assert target.ssh(name, key).returncode == 255

    result = target.reconcile(state(user(name, uid, public, sudo=True)))

    assert result.values["users_created"] == "0"
    assert target.ssh(name, key, "sudo -n true").returncode == 0
    fields = target.shadow(name)
    assert fields[1] == "*" and fields[7] == ""


def test_a_user_revoked_before_their_account_existed_gets_a_locked_account(target):
    name, uid = new_name(), next(_uids)
    result = target.reconcile(state(user(name, uid, target.new_key("x")[1], active=False)))
    assert result.values["users_created"] == "1"
    fields = target.shadow(name)
    assert fields[1] == "!*" and fields[7] == "1"
    assert target.sh(f"ls {KEYS_DIR}/{name} 2>&1; true").count("No such file") == 1


# --- a collaborator's symlinks never lead a root write ------------------------------

SYMLINK_ATTACKS = {
    "ssh folder to /etc": "rm -rf .ssh && ln -s /etc .ssh",
    "authorized_keys to /etc/shadow": "mkdir -p .ssh && ln -sf /etc/shadow .ssh/authorized_keys",
    "authorized_keys to sshd_config": (
        "mkdir -p .ssh && ln -sf /etc/ssh/sshd_config .ssh/authorized_keys"
    ),
    "authorized_keys2 to sudoers": "mkdir -p .ssh && ln -sf /etc/sudoers .ssh/authorized_keys2",
}
WATCHED = "/etc/shadow /etc/passwd /etc/group /etc/sudoers /etc/ssh/sshd_config"


@pytest.mark.parametrize("attack", SYMLINK_ATTACKS.values(), ids=SYMLINK_ATTACKS.keys())
def test_a_symlink_in_the_home_never_leads_a_root_write_outside_it(target, attack):
    name, uid = new_name(), next(_uids)
    first_key, first_public = target.new_key("one")
    second_key, second_public = target.new_key("two")
    target.reconcile(state(user(name, uid, first_public)))
    target.as_user(uid, attack)
    links = target.sh(f"find /home/{name} -type l -printf '%p -> %l\\n' | sort")
    watched = target.sh(f"sha256sum {WATCHED}; stat -c '%n %a %U' {WATCHED}")

    # New keys and sudo: the run writes key and sudoers files for this user.
    result = target.reconcile(state(user(name, uid, first_public, second_public, sudo=True)))

    assert result.values["keys_written"] == "1"
    assert target.sh(f"sha256sum {WATCHED}; stat -c '%n %a %U' {WATCHED}") == watched
    assert target.sh(f"find /home/{name} -type l -printf '%p -> %l\\n' | sort") == links
    assert target.ssh(name, second_key, "sudo -n true").returncode == 0

    revoke = target.reconcile(state(user(name, uid, first_public, active=False)))

    assert revoke.values["revoked"] == "1"
    after = target.sh(f"sha256sum {WATCHED}; stat -c '%n %a %U' {WATCHED}")
    # Only the shadow entry of this user changed (locked and expired).
    assert [ln for ln in after.splitlines() if "shadow" not in ln] == [
        ln for ln in watched.splitlines() if "shadow" not in ln
    ]
    assert target.sh(f"find /home/{name} -type l -printf '%p -> %l\\n' | sort") == links
    assert target.ssh(name, second_key).returncode == 255


# --- hostile input ------------------------------------------------------------------

GOOD_KEY = (
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl milo@laptop"
)
HOSTILE_USERS = {
    "shell separator": DesiredUser("milo;reboot", 30001, True, False, ()),
    "command substitution": DesiredUser("$(id)", 30001, True, False, ()),
    "upper case": DesiredUser("Milo", 30001, True, False, ()),
    "leading dash": DesiredUser("-milo", 30001, True, False, ()),
    "newline in name": DesiredUser("milo\nuser root 30002 1 1", 30001, True, False, ()),
    "uid outside the range": DesiredUser("milo", 0, True, False, ()),
    "uid as text": DesiredUser("milo", "30001", True, False, ()),  # type: ignore[arg-type]
    "nobody's uid": DesiredUser("milo", 65534, True, False, ()),
    "active as text": DesiredUser("milo", 30001, "yes", False, ()),  # type: ignore[arg-type]
    "key with options": DesiredUser("milo", 30001, True, False, ('command="/bin/sh" ' + GOOD_KEY,)),
    "second key after a newline": DesiredUser(
        "milo", 30001, True, False, (GOOD_KEY + "\n" + GOOD_KEY,)
    ),
    "second key as the comment": DesiredUser(
        "milo", 30001, True, False, (GOOD_KEY.rsplit(" ", 1)[0] + " " + GOOD_KEY,)
    ),
    "carriage return": DesiredUser("milo", 30001, True, False, (GOOD_KEY + "\r",)),
    "comment with a quote": DesiredUser("milo", 30001, True, False, (GOOD_KEY + "'x",)),
    "not base64": DesiredUser("milo", 30001, True, False, ("ssh-ed25519 AAAA$(id)AAA milo",)),
    "type does not match the data": DesiredUser(
        "milo", 30001, True, False, ("ssh-rsa " + GOOD_KEY.split()[1],)
    ),
    "dsa key": DesiredUser("milo", 30001, True, False, ("ssh-dss AAAAB3NzaC1kc3MAAACBAP8=",)),
    "keys as one string": DesiredUser("milo", 30001, True, False, GOOD_KEY),  # type: ignore[arg-type]
}
HOSTILE_MOUNTS = {
    "dot-dot": DesiredMount("disk-1", "/mnt/../etc", False),
    "dot": DesiredMount("disk-1", "/mnt/./data", False),
    "relative": DesiredMount("disk-1", "mnt/data", False),
    "system folder": DesiredMount("disk-1", "/etc", False),
    "under a home": DesiredMount("disk-1", "/home/milo/data", False),
    "root": DesiredMount("disk-1", "/", False),
    "space": DesiredMount("disk-1", "/mnt/my data", False),
    "trailing slash": DesiredMount("disk-1", "/mnt/data/", False),
    "device with a slash": DesiredMount("../sda", "/mnt/data", False),
    "device upper case": DesiredMount("Disk-1", "/mnt/data", False),
}


@pytest.mark.parametrize("bad", HOSTILE_USERS.values(), ids=HOSTILE_USERS.keys())
def test_the_encoder_refuses_a_hostile_user(bad):
    with pytest.raises(ValueError):
        encode(state(bad))


@pytest.mark.parametrize("bad", HOSTILE_MOUNTS.values(), ids=HOSTILE_MOUNTS.keys())
def test_the_encoder_refuses_a_hostile_mount(bad):
    with pytest.raises(ValueError):
        encode(state(mounts=(bad,)))


def test_the_encoder_refuses_duplicates_and_bad_ranges():
    one = DesiredUser("milo", 30001, True, False, ())
    with pytest.raises(ValueError):
        encode(state(one, DesiredUser("milo", 30002, True, False, ())))
    with pytest.raises(ValueError):
        encode(state(one, DesiredUser("ana", 30001, True, False, ())))
    with pytest.raises(ValueError):
        encode(DesiredState(users=(), mounts=(), uid_min=0, uid_max=10))
    with pytest.raises(ValueError):
        encode(DesiredState(users=(), mounts=(), uid_min=5000, uid_max=4000))


def test_the_encoder_writes_the_documented_format():
    desired = state(
        DesiredUser("milo", 30001, True, True, (GOOD_KEY, GOOD_KEY.rsplit(" ", 1)[0])),
        DesiredUser("ana", 30002, False, True, (GOOD_KEY,)),  # revoked: no keys, no sudo
        mounts=(DesiredMount("persistent-disk-1", "/mnt/disks/data", True),),
    )
    blob = GOOD_KEY.split()[1]
    assert encode(desired).decode().splitlines() == [
        "tpu-portal-desired 1",
        f"range {UID_MIN} {UID_MAX}",
        "user milo 30001 1 1",
        f"key milo ssh-ed25519 {blob} milo@laptop",
        f"key milo ssh-ed25519 {blob}",
        "user ana 30002 0 0",
        "mount persistent-disk-1 /mnt/disks/data ro",
        "end",
    ]


def hostile_streams(name: str, uid: int) -> dict[str, bytes]:
    blob = GOOD_KEY.split()[1]
    head = f"tpu-portal-desired 1\nrange {UID_MIN} {UID_MAX}\n"
    ok = f"user {name} {uid} 1 1\nkey {name} ssh-ed25519 {blob} x\n"
    streams = {
        "no header": f"range {UID_MIN} {UID_MAX}\n{ok}end\n",
        "wrong version": f"tpu-portal-desired 2\nrange {UID_MIN} {UID_MAX}\n{ok}end\n",
        "cut short": head + ok,
        "cut inside a line": head + ok[:-10],
        "no final newline": head + ok + "end",
        "end in the middle": head + "end\n" + ok + "end\n",
        "a cut-off end after end": head + ok + "end\nend",
        "a line too long": head + ok + f"key {name} ssh-ed25519 {'A' * 4400}\nend\n",
        "command substitution": head + ok + f"user $(touch${{IFS}}/tmp/pwned) {uid + 1} 1 1\nend\n",
        "backticks": head + ok + "user `reboot` 30001 1 1\nend\n",
        "semicolon": head + ok + f"user milo;reboot {uid + 1} 1 1\nend\n",
        "key options": head + ok + f'key {name} command="sh" ssh-ed25519 {blob}\nend\n',
        "two keys on a line": head
        + ok
        + f"key {name} ssh-ed25519 {blob} ssh-ed25519 {blob}\nend\n",
        "key for an unlisted user": head + ok + f"key root ssh-ed25519 {blob} x\nend\n",
        "root's uid": head + ok + "user toor 0 1 1\nend\n",
        "uid outside the range": head + ok + f"user {name}b {UID_MAX + 1} 1 1\nend\n",
        "user listed twice": head + ok + f"user {name} {uid + 1} 1 1\nend\n",
        "uid listed twice": head + ok + f"user {name}b {uid} 1 1\nend\n",
        "tab separated": head + ok + f"user\t{name}b\t{uid + 1}\t1\t1\nend\n",
        "mount dot-dot": head + ok + "mount disk-1 /mnt/../etc rw\nend\n",
        "mount on /etc": head + ok + "mount disk-1 /etc rw\nend\n",
        "mount under a home": head + ok + f"mount disk-1 /home/{name}/x rw\nend\n",
        "unknown record": head + ok + "exec rm -rf /\nend\n",
        "range below 1000": f"tpu-portal-desired 1\nrange 1 {UID_MAX}\n{ok}end\n",
    }
    encoded = {label: text.encode() for label, text in streams.items()}
    encoded["nul byte"] = (head + ok).encode() + b"user a\x00b 30001 1 1\nend\n"
    encoded["carriage return"] = (head + ok).encode() + b"end\r\nend\n"
    encoded["not ascii"] = (head + ok).encode() + "user mílo 30001 1 1\nend\n".encode()
    return encoded


def test_the_script_refuses_hostile_streams_and_changes_nothing(target):
    name, uid = new_name(), next(_uids)
    target.reconcile(state())  # the host is prepared; later runs change nothing
    before = target.snapshot()

    for label, stream in hostile_streams(name, uid).items():
        with pytest.raises(RemoteError) as caught:
            target.reconcile(stream)
        assert caught.value.kind == RemoteError.SCRIPT, label
        assert "reconcile: " in str(caught.value), label

    assert target.snapshot() == before
    assert target.sh(f"getent passwd {name}; ls /tmp | grep pwned", check=False) == ""


def test_a_stream_too_large_is_refused_whole(target):
    name, uid = new_name(), next(_uids)
    target.reconcile(state())
    before = target.snapshot()
    blob = GOOD_KEY.split()[1]
    line = f"key {name} ssh-ed25519 {blob}\n"
    body = f"user {name} {uid} 1 1\n" + line * (16 * 1024 * 1024 // len(line) + 1)
    stream = f"tpu-portal-desired 1\nrange {UID_MIN} {UID_MAX}\n{body}end\n".encode()

    with pytest.raises(RemoteError, match="larger than 16777216 bytes"):
        target.reconcile(stream)

    assert target.snapshot() == before


def test_a_stream_cut_short_changes_nothing(target):
    name, uid = new_name(), next(_uids)
    data = encode(state(user(name, uid, target.new_key("cut")[1], sudo=True)))
    target.reconcile(state())
    before = target.snapshot()

    for cut in (len(data) - 4, len(data) // 2, 25):
        with pytest.raises(RemoteError, match="cut short|does not end"):
            target.reconcile(data[:cut])

    assert target.snapshot() == before


# --- clashes, drift and passwords ---------------------------------------------------


def test_a_uid_clash_fails_that_user_only(target):
    renumbered, squatter, blocked, fine = (new_name() for _ in range(4))
    uid_a, uid_c, uid_d = (next(_uids) for _ in range(3))
    # Someone made these by hand: `renumbered` with another uid, `squatter` on uid_c.
    target.sh(
        f"useradd -M -u {uid_a + 5000} {renumbered}; useradd -M -u {uid_c} {squatter}",
    )
    _, public = target.new_key("k")

    result = target.reconcile(
        state(user(renumbered, uid_a, public), user(blocked, uid_c, public),
              user(fine, uid_d, public)),
    )  # fmt: skip

    errors = dict(e.split(":", 1) for e in result.all("user_error"))
    assert set(errors) == {renumbered, blocked}
    assert f"exists with uid {uid_a + 5000}" in errors[renumbered]
    assert f"uid {uid_c} belongs to {squatter}" in errors[blocked]
    # Nothing was re-numbered, and no key was written for a name that is someone else's.
    assert target.sh(f"id -u {renumbered}").strip() == str(uid_a + 5000)
    assert target.sh(f"getent passwd {blocked}", check=False) == ""
    assert target.sh(f"ls {KEYS_DIR}").split().count(renumbered) == 0
    assert target.sh(f"id -u {fine}").strip() == str(uid_d)
    assert squatter in result.all("drift_user")


def test_accounts_the_portal_did_not_list_are_reported_and_left_alone(target):
    listed, stranger = new_name(), new_name()
    stranger_uid = next(_uids)
    target.sh(f"useradd -m -u {stranger_uid} {stranger}")
    # A keys file in the portal's folder for someone it no longer lists is removed.
    target.sh(f"mkdir -p {KEYS_DIR} && echo '{GOOD_KEY}' > {KEYS_DIR}/{stranger}")

    result = target.reconcile(state(user(listed, next(_uids), target.new_key("d")[1])))

    assert stranger in result.all("drift_user")
    assert listed not in result.all("drift_user")
    assert target.fleet.admin_user not in result.all("drift_user")  # outside the portal's range
    assert target.sh(f"id -u {stranger}").strip() == str(stranger_uid)
    assert target.sh(f"ls {KEYS_DIR}").split().count(stranger) == 0


def test_five_users_at_once_and_no_account_has_a_usable_password(target):
    key, public = target.new_key("five")
    users = [
        user(new_name(), next(_uids), public, sudo=i % 2 == 0, active=i != 4) for i in range(5)
    ]

    full = target.reconcile(state(*users))
    noop = target.reconcile(state(*users))

    assert full.values["users_created"] == "5"
    assert noop.values["noop"] == "1"
    print(f"\nfull reconcile of 5 users: {full.elapsed:.2f} s; no-op: {noop.elapsed:.2f} s")
    assert target.ssh(users[0].username, key, "sudo -n true").returncode == 0
    # Every account in the portal's range: '*' (no password) or '!*' (locked, none).
    shadow = target.sh("cat /etc/shadow")
    passwd = target.sh("cat /etc/passwd")
    in_range = {
        f[0]
        for f in (ln.split(":") for ln in passwd.splitlines())
        if UID_MIN <= int(f[2]) <= UID_MAX
    }
    portal = {u.username for u in users}
    assert portal <= in_range
    for line in shadow.splitlines():
        fields = line.split(":")
        if fields[0] in portal:
            assert fields[1] in ("*", "!*"), fields[0]


# --- sshd configuration -------------------------------------------------------------

DROPIN = "/etc/ssh/sshd_config.d/50-tpu-portal.conf"


def test_a_broken_sshd_configuration_stops_the_run_and_nothing_is_left_behind(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("cfg")
    broken = "/etc/ssh/sshd_config.d/10-broken.conf"
    target.sh(f"rm -f {DROPIN}; echo 'NoSuchOption yes' > {broken}")
    try:
        with pytest.raises(RemoteError) as caught:
            target.reconcile(state(user(name, uid, public)))
        assert "sshd configuration is already invalid" in str(caught.value)
        assert "NoSuchOption" in str(caught.value)
        assert target.sh(f"ls {DROPIN} 2>&1; true").count("No such file") == 1
        assert target.sh(f"getent passwd {name}", check=False) == ""
    finally:
        target.sh(f"rm -f {broken}")

    result = target.reconcile(state(user(name, uid, public)))

    assert result.values["users_created"] == "1"
    assert target.sh("sshd -T | grep -i ^authorizedkeysfile").split()[1:] == [
        ".ssh/authorized_keys", ".ssh/authorized_keys2", f"{KEYS_DIR}/%u"
    ]  # fmt: skip
    assert target.ssh(name, key).returncode == 0


# An sshd that refuses any configuration holding the portal's current drop-in, as a
# future sshd might refuse one of its lines; everything else goes to the real sshd.
# It replaces /usr/sbin/sshd in this host's mount namespace only.
REFUSING_SSHD = """#!/bin/sh
if [ "$1" = -t ] && grep -q -s '^# Managed by TPU Portal' /etc/ssh/sshd_config.d/*.conf; then
    echo "50-tpu-portal.conf line 3: unsupported option" >&2
    exit 255
fi
exec /root/sshd.real "$@"
"""


@contextlib.contextmanager
def refusing_sshd(target):
    target.sh("cp /usr/sbin/sshd /root/sshd.real && cat > /root/sshd.refusing && "
              "chmod 0755 /root/sshd.refusing && mount --bind /root/sshd.refusing /usr/sbin/sshd",
              input=REFUSING_SSHD.encode())  # fmt: skip
    try:
        yield
    finally:
        target.sh("umount /usr/sbin/sshd; rm -f /root/sshd.real /root/sshd.refusing")


@pytest.mark.parametrize("before", ["none", "older"])
def test_a_drop_in_that_sshd_refuses_is_rolled_back_and_nothing_else_changes(target, before):
    name, uid = new_name(), next(_uids)
    older = "AuthorizedKeysFile .ssh/authorized_keys /etc/ssh/tpu-portal-keys/%u\n"
    target.reconcile(state())  # (the admin's first sudo since boot leaves a trace)
    if before == "older":
        target.sh(f"cat > {DROPIN} && chmod 0600 {DROPIN}", input=older.encode())
    else:  # a host the portal never touched
        target.sh(f"rm -f {DROPIN}; rm -r {KEYS_DIR}")
    sshd_pid = target.sh("cat /run/sshd.pid")
    # The drop-in's folder itself changes its times: a file came and went in it.
    folder = "/etc/ssh/sshd_config.d d "
    snapshot = [ln for ln in target.snapshot().splitlines() if not ln.startswith(folder)]

    with refusing_sshd(target), pytest.raises(RemoteError) as caught:
        target.reconcile(state(user(name, uid, target.new_key("refused")[1])))

    assert "sshd -t refused the configuration with the portal's drop-in" in str(caught.value)
    assert "unsupported option" in str(caught.value)
    assert not caught.value.retryable
    if before == "older":
        assert target.sh(f"cat {DROPIN}") == older
        assert target.sh(f"stat -c %a {DROPIN}").strip() == "600"
    else:
        assert target.sh(f"ls {DROPIN} 2>&1; true").count("No such file") == 1
    # No account, no key file, nothing else.
    assert [ln for ln in target.snapshot().splitlines() if not ln.startswith(folder)] == snapshot
    assert target.sh("cat /run/sshd.pid") == sshd_pid  # never reloaded


def test_a_drop_in_that_was_written_but_never_loaded_is_loaded_by_the_next_run(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("late")
    target.reconcile(state())
    # As if a run had written the drop-in and died before reloading sshd.
    target.sh(f"touch {DROPIN}")
    time.sleep(0.05)

    result = target.reconcile(state(user(name, uid, public)))

    assert result.values["sshd_reloaded"] == "1"
    assert target.ssh(name, key).returncode == 0
    again = target.reconcile(state(user(name, uid, public)))
    assert again.values["sshd_reloaded"] == "0" and again.values["noop"] == "1"


def test_an_in_place_edit_of_another_sshd_file_is_checked_by_the_next_run(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("edit")
    other = "/etc/ssh/sshd_config.d/10-other.conf"
    target.sh(f"echo '# nothing yet' > {other}")
    try:
        target.reconcile(state(user(name, uid, public)))
        assert target.reconcile(state(user(name, uid, public))).values["noop"] == "1"
        # Same file, same inode, same folder: only its own times and size change.
        target.sh(f"echo 'AuthorizedKeysFile .ssh/elsewhere' >> {other}")

        with pytest.raises(RemoteError) as caught:
            target.reconcile(state(user(name, uid, public)))

        assert "sshd does not use the portal's key files" in str(caught.value)
    finally:
        target.sh(f"rm -f {other}")
    assert target.reconcile(state(user(name, uid, public))).values["noop"] == "1"
    assert target.ssh(name, key).returncode == 0


# --- data disks ---------------------------------------------------------------------


def test_a_disk_whose_device_is_not_there_yet_waits_without_an_fstab_line(target):
    # /mnt is private to each fleet host; the fleet has no Google disks.
    point = f"/mnt/disks/{new_name()}"
    data = DesiredMount("persistent-disk-7", point, read_only=True)
    scratch = DesiredMount("scratch-2", f"{point}-scratch", read_only=False)
    # The host is shared with the session's other tests: none of their disks' lines
    # stays in its fstab for this run to remove.
    target.reconcile(state())
    before = target.sh("cat /etc/fstab")

    first = target.reconcile(state(mounts=(data, scratch)))
    second = target.reconcile(state(mounts=(data, scratch)))

    assert first.all("waiting_device") == ["persistent-disk-7", "scratch-2"]
    assert second.values["noop"] == "1"
    assert second.all("waiting_device") == ["persistent-disk-7", "scratch-2"]
    # Not mounted, so not in fstab: at the next boot mount would otherwise put the
    # disk over whatever the folder holds by then.
    assert first.values["fstab_written"] == "0"
    assert target.sh("cat /etc/fstab") == before
    assert target.sh(f"stat -c '%F %U %a' {point}").strip() == "directory root 755"

    target.reconcile(state())
    assert target.sh("cat /etc/fstab") == before


def test_a_mount_point_reached_through_a_symlink_is_refused(target):
    name = new_name()
    home_owner = next(_uids)
    target.sh(f"useradd -m -u {home_owner} {name} && ln -s /home/{name} /mnt/{name}")

    result = target.reconcile(state(mounts=(DesiredMount("disk-9", f"/mnt/{name}/data", False),)))

    assert result.all("mount_error") == [
        f"disk-9:/mnt/{name}/data is not a plain folder or lies below a symlink or a folder "
        "others can write to"
    ]
    assert "data" not in target.sh(f"ls -A /home/{name}").split()
    assert target.fstab_lines() == []  # at boot, mount would follow the link


@contextlib.contextmanager
def attached_disk(target, tmp_path: Path, *, blank: bool, tree: Path | None = None):
    """A real disk that the host sees as /dev/disk/by-id/google-<name> (ext4, holding
    a copy of ``tree`` if given, or blank as Google hands out a new disk): a loop
    device, its node made in the host's own /dev. The host is rebooted afterwards,
    which gives it a fresh /dev and drops every mount, and the loop device is
    detached."""
    image = tmp_path / "disk.img"
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    if not blank:
        populate = ["-d", str(tree)] if tree else []
        subprocess.run(["mkfs.ext4", "-q", "-F", *populate, str(image)], check=True)
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    name = f"test-{secrets.token_hex(3)}"
    rdev = os.stat(loop).st_rdev
    try:
        target.sh(
            f"[ -e {loop} ] || mknod -m 660 {loop} b {os.major(rdev)} {os.minor(rdev)}; "
            f"mkdir -p /dev/disk/by-id && ln -s {loop} /dev/disk/by-id/google-{name}"
        )
        yield name
    finally:
        target.fleet.reboot(target.host.name)
        subprocess.run(["losetup", "-d", loop], check=False)


@pytest.fixture
def google_disk(target, tmp_path):
    with attached_disk(target, tmp_path, blank=False) as name:
        yield name


@pytest.fixture
def blank_google_disk(target, tmp_path):
    with attached_disk(target, tmp_path, blank=True) as name:
        yield name


def test_a_blank_disk_is_formatted_once_when_attached_read_write(target, blank_google_disk):
    disk, point = blank_google_disk, f"/mnt/disks/{new_name()}"

    read_only = target.reconcile(state(mounts=(DesiredMount(disk, point, True),)))

    assert read_only.all("mount_error") == [
        f"{disk}:the disk is blank (no filesystem): attach it read-write to one single-worker "
        "VM once and the portal formats it"
    ]
    assert read_only.values["formatted"] == "0"
    assert target.sh(f"findmnt -n {point}; blkid -p /dev/disk/by-id/google-{disk}; true") == ""

    first = target.reconcile(state(mounts=(DesiredMount(disk, point, False),)))

    assert first.values["formatted"] == "1" and first.values["mounted"] == "1"
    fstype, options = target.sh(f"findmnt -n -o FSTYPE,OPTIONS {point}").split()
    assert fstype == "ext4" and options.startswith("rw,")
    # Shared like /tmp: anyone may create files there, only their owner removes them.
    assert target.sh(f"stat -c '%a %U' {point}").strip() == "1777 root"
    target.sh(f"echo results > {point}/kept")
    assert target.reconcile(state()).values["unmounted"] == "1"

    again = target.reconcile(state(mounts=(DesiredMount(disk, point, False),)))

    assert again.values["formatted"] == "0" and again.values["mounted"] == "1"
    assert target.sh(f"cat {point}/kept") == "results\n"


def test_an_attached_disk_is_mounted_remounted_and_unmounted(target, google_disk):
    point = f"/mnt/disks/{new_name()}"

    first = target.reconcile(state(mounts=(DesiredMount(google_disk, point, True),)))
    again = target.reconcile(state(mounts=(DesiredMount(google_disk, point, True),)))

    assert first.values["mounted"] == "1" and again.values["noop"] == "1"
    assert first.values["formatted"] == "0"  # it had a filesystem: never formatted
    assert target.sh(f"findmnt -n -o OPTIONS {point}").startswith("ro,")
    writable = target.reconcile(state(mounts=(DesiredMount(google_disk, point, False),)))
    assert writable.values["changed"] != "0"
    assert target.sh(f"findmnt -n -o OPTIONS {point}").startswith("rw,")

    # A disk in use is not yanked away: its line stays until it can be unmounted.
    busy_pid = target.sh(f"cd {point} && sleep 60 </dev/null >/dev/null 2>&1 & echo $!").strip()
    busy = target.reconcile(state())
    assert busy.all("mount_error")[0].startswith(f"{google_disk}:cannot unmount {point}")
    # What holds it is named, so an admin knows whom to ask.
    assert f"(held by pid {busy_pid} sleep of root)" in busy.all("mount_error")[0]
    assert len(target.fstab_lines()) == 1
    target.sh(f"kill -KILL {busy_pid}; sleep 0.2")
    freed = target.reconcile(state())
    assert freed.values["unmounted"] == "1"
    assert target.fstab_lines() == []
    assert target.sh(f"findmnt -n {point}; true") == ""


def test_a_disk_is_never_mounted_over_files_nor_given_an_fstab_line(target, google_disk):
    point = f"/mnt/disks/{new_name()}"
    target.sh(f"mkdir -p {point} && echo keep > {point}/notes")
    before = target.sh("cat /etc/fstab")

    result = target.reconcile(state(mounts=(DesiredMount(google_disk, point, False),)))

    assert result.all("mount_error") == [
        f"{google_disk}:{point} is not empty, not mounting over it"
    ]
    assert target.sh(f"cat {point}/notes") == "keep\n"
    # No fstab line either: the next boot would mount the disk over the files.
    assert result.values["fstab_written"] == "0"
    assert target.sh("cat /etc/fstab") == before
    assert target.sh(f"findmnt -n {point}; true") == ""

    # Once the folder is empty, the disk is mounted, and only then has its line.
    target.sh(f"mv {point}/notes /root/notes-{google_disk}")
    mounted = target.reconcile(state(mounts=(DesiredMount(google_disk, point, False),)))

    assert mounted.values["mounted"] == "1" and mounted.values["fstab_written"] == "1"
    assert target.fstab_lines() == [
        f"/dev/disk/by-id/google-{google_disk} {point} ext4 "
        "rw,nosuid,nodev,discard,defaults,nofail 0 2 # tpu-portal"
    ]
    assert target.sh(f"findmnt -n -o OPTIONS {point}").startswith("rw,nosuid,nodev")


def test_a_disk_mounted_elsewhere_by_hand_gets_no_fstab_line(target, google_disk):
    point = f"/mnt/disks/{new_name()}"
    target.sh(f"mkdir -p {point} && mount -t tmpfs scratch {point}")
    before = target.sh("cat /etc/fstab")

    result = target.reconcile(state(mounts=(DesiredMount(google_disk, point, True),)))

    assert result.all("mount_error") == [
        f"{google_disk}:{point} has another filesystem mounted (scratch)"
    ]
    assert result.values["fstab_written"] == "0"
    assert target.sh("cat /etc/fstab") == before


def test_a_disk_that_went_away_while_mounted_is_unmounted_not_left_stale(target, google_disk):
    point = f"/mnt/disks/{new_name()}"
    target.reconcile(state(mounts=(DesiredMount(google_disk, point, True),)))
    loop = target.sh(f"readlink -f /dev/disk/by-id/google-{google_disk}").strip()
    # Detached outside the portal: the device and its link are gone, the mount stays.
    target.sh(f"rm /dev/disk/by-id/google-{google_disk} {loop}")

    result = target.reconcile(state())

    assert result.values["unmounted"] == "1"
    assert result.all("mount_error") == []
    assert target.sh(f"findmnt -n {point}; true") == ""
    assert target.fstab_lines() == []


def test_a_symlinked_fstab_stops_the_disks_only_and_access_still_changes(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("ana")
    target.sh("mv /etc/fstab /etc/fstab.real && ln -s /etc/fstab.real /etc/fstab")
    try:
        mount = DesiredMount("scratch-3", f"/mnt/disks/{new_name()}", read_only=False)

        granted = target.reconcile(state(user(name, uid, public), mounts=(mount,)))
        assert target.ssh(name, key).returncode == 0
        revoked = target.reconcile(state(user(name, uid, active=False), mounts=(mount,)))

        for result in (granted, revoked):
            assert result.all("disk_error") == ["/etc/fstab is a symlink  not replacing it"]
        assert revoked.values["revoked"] == "1"
        assert target.ssh(name, key).returncode != 0
        assert target.sh("readlink /etc/fstab").strip() == "/etc/fstab.real"
    finally:
        target.sh("rm /etc/fstab && mv /etc/fstab.real /etc/fstab")


def test_a_disks_part_that_stops_is_an_answer_not_a_failed_run(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("lea")
    folder = f"/mnt/{new_name()}"
    # The mount point's folder cannot be made (a read-only filesystem above it):
    # mkdir fails, and set -e stops the disks' part there.
    target.sh(f"mkdir -p {folder} && mount -t tmpfs -o ro,mode=0755 tmpfs {folder}")
    try:
        result = target.reconcile(
            state(
                user(name, uid, public),
                mounts=(DesiredMount("scratch-4", f"{folder}/data", False),),
            )
        )

        [error] = result.all("disk_error")
        assert error.startswith("the disks part stopped: mkdir"), error
        assert "Read-only file system" in error
        assert result.values["keys_written"] == "1"
        assert "noop" not in result.values
        assert target.ssh(name, key).returncode == 0
    finally:
        target.reconcile(state(user(name, uid, active=False)))
        target.sh(f"umount {folder}")

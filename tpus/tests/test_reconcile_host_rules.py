"""reconcile.sh on real fleet hosts: what a collaborator can and cannot carry from one
VM to another, or keep after the portal takes it away (data disks, keys, names)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from tpus.remote import RemoteError
from tpus.remote.desired import DesiredMount
from tpus.tests.test_reconcile_script import (
    Target,
    _uids,
    attached_disk,
    new_name,
    state,
    user,
)

pytestmark = pytest.mark.fleet

NOBODY = 65534


@pytest.fixture
def target(fleet, fleet_settings, fleet_host, tmp_path) -> Target:
    return Target(fleet, fleet_host, tmp_path)


# --- data disks ---------------------------------------------------------------------


@contextlib.contextmanager
def disk_left_by_root_elsewhere(target: Target, tmp_path: Path):
    """A disk as root on another VM could leave it: a root-owned setuid copy of `id`
    and a world-writable device node for /dev/zero, made with mkfs.ext4 -d."""
    tree = tmp_path / "tree"
    tree.mkdir()
    subprocess.run(["cp", "/usr/bin/id", str(tree / "rootid")], check=True)
    (tree / "rootid").chmod(0o4755)
    subprocess.run(["mknod", "-m", "666", str(tree / "zero"), "c", "1", "5"], check=True)
    with attached_disk(target, tmp_path, blank=False, tree=tree) as name:
        yield name


def as_nobody(target: Target, command: list[str]) -> subprocess.CompletedProcess:
    return target.fleet.exec(
        target.host.name,
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *command],
        check=False,
    )


def assert_setuid_and_devices_give_nothing(target: Target, point: str) -> None:
    options = target.sh(f"findmnt -n -o OPTIONS {point}").strip().split(",")
    assert "nosuid" in options and "nodev" in options, options
    # The bit is on the file, owned by root, and still gives no root to a user.
    assert target.sh(f"stat -c '%A %U' {point}/rootid").split() == ["-rwsr-xr-x", "root"]
    ran = as_nobody(target, [f"{point}/rootid", "-u"])
    assert ran.returncode == 0 and ran.stdout.decode().strip() == str(NOBODY)
    node = as_nobody(target, ["head", "-c", "1", f"{point}/zero"])
    assert node.returncode != 0 and b"Permission denied" in node.stderr


def test_a_setuid_binary_left_on_a_disk_gives_no_root_where_it_is_mounted(target, tmp_path):
    point = f"/mnt/disks/{new_name()}"
    with disk_left_by_root_elsewhere(target, tmp_path) as disk:
        result = target.reconcile(state(mounts=(DesiredMount(disk, point, read_only=True),)))

        assert result.values["mounted"] == "1"
        assert target.fstab_lines() == [
            f"/dev/disk/by-id/google-{disk} {point} ext4 ro,nosuid,nodev,discard,defaults,"
            "nofail 0 2 # tpu-portal"
        ]
        assert_setuid_and_devices_give_nothing(target, point)


def test_a_disk_mounted_by_an_earlier_version_is_remounted_nosuid_nodev(target, tmp_path):
    point = f"/mnt/disks/{new_name()}"
    with disk_left_by_root_elsewhere(target, tmp_path) as disk:
        # What an earlier version left: its fstab line, and the disk mounted by it.
        source = f"/dev/disk/by-id/google-{disk}"
        target.sh(
            f"mkdir -p {point} && echo '{source} {point} ext4 ro,discard,defaults,nofail 0 2 "
            f"# tpu-portal' >> /etc/fstab && mount {point}"
        )
        ran = as_nobody(target, [f"{point}/rootid", "-u"])
        assert ran.stdout.decode().strip() == "0"  # the hole this closes

        first = target.reconcile(state(mounts=(DesiredMount(disk, point, read_only=True),)))

        assert first.values["fstab_written"] == "1" and first.values["mounted"] == "0"
        assert first.all("mount_error") == []
        assert_setuid_and_devices_give_nothing(target, point)
        assert target.fstab_lines() == [
            f"{source} {point} ext4 ro,nosuid,nodev,discard,defaults,nofail 0 2 # tpu-portal"
        ]
        # Remounted by hand without them: the next run puts them back, then rests.
        target.sh(f"mount -o remount,suid,dev {point}")
        second = target.reconcile(state(mounts=(DesiredMount(disk, point, read_only=True),)))
        assert second.values["changed"] == "1"
        assert_setuid_and_devices_give_nothing(target, point)
        third = target.reconcile(state(mounts=(DesiredMount(disk, point, read_only=True),)))
        assert third.values["noop"] == "1"


# --- only the portal's keys open the portal's accounts -------------------------------

KEYS_DIR = "/etc/ssh/tpu-portal-keys"
PORTAL_GROUP = "tpu-portal-users"


def effective_keys_files(target: Target, name: str) -> list[str]:
    """What sshd reads for a login by ``name`` (Match blocks applied)."""
    out = target.sh(f"sshd -T -C user={name},host=localhost,addr=127.0.0.1")
    line = next(ln for ln in out.splitlines() if ln.startswith("authorizedkeysfile "))
    return line.split()[1:]


def test_a_key_copied_into_the_home_opens_nothing_and_a_deleted_key_locks_them_out(target):
    name, uid = new_name(), next(_uids)
    portal_key, public = target.new_key("portal")
    own_key, own_public = target.new_key("own")
    target.reconcile(state(user(name, uid, public)))
    target.as_user(uid, f"mkdir -m 700 .ssh && echo '{own_public}' > .ssh/authorized_keys")

    assert target.ssh(name, own_key).returncode == 255
    assert target.ssh(name, portal_key).returncode == 0
    assert effective_keys_files(target, name) == [f"{KEYS_DIR}/%u"]
    assert PORTAL_GROUP in target.sh(f"id -Gn {name}").split()

    # The portal deletes the user's only key: they keep access to nothing.
    result = target.reconcile(state(user(name, uid)))

    assert result.values["keys_removed"] == "1"
    for key in (portal_key, own_key):
        assert target.ssh(name, key).returncode == 255


def test_accounts_the_portal_did_not_make_keep_their_own_authorized_keys(target, fleet):
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("portal")
    lab_admin = new_name()
    lab_admin_key, lab_admin_public = target.new_key("labadmin")
    service_key, service_public = target.new_key("service")
    target.sh(
        f"useradd -m -s /bin/bash {lab_admin} && install -d -o {lab_admin} -m 700 "
        f"/home/{lab_admin}/.ssh && echo '{lab_admin_public}' > /home/{lab_admin}/.ssh/"
        f"authorized_keys && chown {lab_admin} /home/{lab_admin}/.ssh/authorized_keys"
    )
    # The portal's service account, as Google's guest agent makes it from metadata.
    fleet.set_ssh_keys(target.host.name, {"tpu-portal": [service_public]})

    target.reconcile(state(user(name, uid, public)))

    default = [".ssh/authorized_keys", ".ssh/authorized_keys2", f"{KEYS_DIR}/%u"]
    for account, key in ((lab_admin, lab_admin_key), ("tpu-portal", service_key)):
        assert effective_keys_files(target, account) == default
        assert target.ssh(account, key).returncode == 0, account
    admin = target.ssh(fleet.admin_user, fleet.admin_key_path, "sudo -n true")
    assert admin.returncode == 0, admin.stderr
    assert PORTAL_GROUP not in target.sh(f"id -Gn {fleet.admin_user}").split()


def test_an_account_made_by_an_earlier_version_is_taken_over_and_loses_its_own_keys(target):
    name, uid = new_name(), next(_uids)
    portal_key, public = target.new_key("portal")
    own_key, own_public = target.new_key("own")
    # What an earlier version made: a group of the user's name with gid = uid, the user.
    target.sh(
        f"groupadd -g {uid} {name} && useradd -m -s /bin/bash -u {uid} -g {uid} -p '*' {name}"
    )
    target.as_user(uid, f"mkdir -m 700 .ssh && echo '{own_public}' > .ssh/authorized_keys")

    result = target.reconcile(state(user(name, uid, public)))

    assert result.all("user_error") == []
    assert result.values["users_created"] == "0"
    assert PORTAL_GROUP in target.sh(f"id -Gn {name}").split()
    assert target.ssh(name, portal_key).returncode == 0
    assert target.ssh(name, own_key).returncode == 255
    assert target.reconcile(state(user(name, uid, public))).values["noop"] == "1"


def test_a_member_removed_from_the_portal_group_by_hand_is_put_back(target):
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("portal")
    target.reconcile(state(user(name, uid, public)))
    target.sh(f"gpasswd -d {name} {PORTAL_GROUP}")

    result = target.reconcile(state(user(name, uid, public)))

    assert result.values["changed"] == "1"
    assert PORTAL_GROUP in target.sh(f"id -Gn {name}").split()


OTHER_DROPIN = "/etc/ssh/sshd_config.d/10-other.conf"


@pytest.mark.parametrize("members", ["already", "none yet"])
def test_a_drop_in_that_gives_the_portals_accounts_their_own_files_stops_the_run(target, members):
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("portal")
    if members == "already":
        target.reconcile(state(user(name, uid, public)))
    else:  # a host where the portal has made no account yet
        # (Other tests on this host may have made it already; on a fresh host it is absent.)
        target.sh(f"if getent group {PORTAL_GROUP} >/dev/null; then groupdel {PORTAL_GROUP}; fi")
    target.sh(
        f"printf 'Match Group {PORTAL_GROUP}\\n    AuthorizedKeysFile .ssh/authorized_keys "
        f"{KEYS_DIR}/%%u\\n' > {OTHER_DROPIN}"
    )
    try:
        with pytest.raises(RemoteError) as caught:
            target.reconcile(state(user(name, uid, public)))

        assert "sshd does not limit the portal's accounts to the portal's key files" in str(
            caught.value
        )
        assert ".ssh/authorized_keys" in str(caught.value)
    finally:
        target.sh(f"rm -f {OTHER_DROPIN}")
    assert target.reconcile(state(user(name, uid, public))).all("user_error") == []


# --- names that exist on the worker already -----------------------------------------


@pytest.mark.parametrize("gid", ["the portal's uid", "a system gid"])
def test_a_group_of_that_name_made_by_someone_else_fails_that_grant(target, gid):
    name, uid, fine, fine_uid = new_name(), next(_uids), new_name(), next(_uids)
    _, public = target.new_key("k")
    # A package's group, say `docker`; with the portal's number the old script joined it.
    target.sh(f"groupadd -g {uid} {name}" if gid == "the portal's uid" else f"groupadd -r {name}")
    before = target.sh(f"getent group {name}")

    result = target.reconcile(
        state(user(name, uid, public, sudo=True), user(fine, fine_uid, public))
    )

    assert result.all("user_error") == [
        f"{name}:a group named {name} already exists on this worker (not created by the portal)"
    ]
    assert target.sh(f"getent passwd {name}", check=False) == ""
    assert target.sh(f"getent group {name}") == before
    assert target.sh(f"ls {KEYS_DIR} /etc/sudoers.d").split().count(name) == 0
    assert target.sh(f"id -u {fine}").strip() == str(fine_uid)


@pytest.mark.parametrize("active", [True, False])
def test_a_user_of_that_name_made_by_someone_else_is_never_taken_over(target, active):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("k")
    target.sh(f"useradd -m -s /bin/bash {name}")
    theirs = target.sh(f"getent passwd {name}; getent shadow {name}; id -Gn {name}")
    their_uid = theirs.split(":")[2]

    result = target.reconcile(state(user(name, uid, public, active=active)))

    assert result.all("user_error") == [
        f"{name}:a user named {name} already exists with uid {their_uid} on this worker "
        "(not created by the portal)"
    ]
    # Not locked, not joined to the portal's group, no key of the portal's.
    assert target.sh(f"getent passwd {name}; getent shadow {name}; id -Gn {name}") == theirs
    assert target.sh(f"ls {KEYS_DIR}").split().count(name) == 0


FAILING_USERADD = """#!/bin/sh
echo "useradd: cannot lock /etc/passwd; try again later." >&2
exit 1
"""


def test_a_group_made_for_an_account_that_could_not_be_made_goes_again(target):
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("k")
    target.sh("cat > /root/useradd.failing && chmod 0755 /root/useradd.failing && "
              "mount --bind /root/useradd.failing /usr/sbin/useradd",
              input=FAILING_USERADD.encode())  # fmt: skip
    try:
        failed = target.reconcile(state(user(name, uid, public)))
    finally:
        target.sh("umount /usr/sbin/useradd; rm -f /root/useradd.failing")

    assert failed.all("user_error") == [
        f"{name}:useradd: useradd: cannot lock /etc/passwd  try again later."
    ]
    assert target.sh(f"getent group {name}", check=False) == ""
    # So the next run does not take the group for someone else's.
    again = target.reconcile(state(user(name, uid, public)))
    assert again.all("user_error") == [] and again.values["users_created"] == "1"
    assert target.ssh(name, key).returncode == 0

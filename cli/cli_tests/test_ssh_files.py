"""The ssh files the client writes, in a temporary home: where the portal's page says,
with the Include line added once at the top of ~/.ssh/config and a backup, idempotent,
and private modes."""

from __future__ import annotations

import stat

import pytest

from tpu_cli import paths, sshfiles

CONFIG = """\
# TPU Portal ssh config for milo, generated {when} UTC.
# Regenerated whenever an IP changes.

# tpu5 (lab vision) needs its host keys in ~/.ssh/tpu-portal_known_hosts, from x/ssh/
Host tpu5
    HostName 10.1.0.1
    User milo
    HostKeyAlias tpu-portal.vision.tpu5.w0
    UserKnownHostsFile ~/.ssh/tpu-portal_known_hosts
    StrictHostKeyChecking yes

Host tpu5-w0
    HostName 10.1.0.1
    User milo
    HostKeyAlias tpu-portal.vision.tpu5.w0

Host tpu5-w1
    HostName {w1}
    User milo
    HostKeyAlias tpu-portal.vision.tpu5.w1

# v2 (lab nlp) needs its host keys in ~/.ssh/tpu-portal_known_hosts, from x/ssh/
Host nlp-v2-us-central1-f
    HostName 10.2.0.1
    User milo
    HostKeyAlias tpu-portal.nlp.v2.us-central1-f.w0
"""


class Portal:
    """What /me/ssh-config and /me/known-hosts answer."""

    def __init__(self):
        self.config = CONFIG.format(when="2026-01-01 10:00", w1="10.1.0.2")
        self.known = "tpu-portal.vision.tpu5.w0 ssh-ed25519 AAAA\n"

    def text(self, path):
        return {"/me/ssh-config": self.config, "/me/known-hosts": self.known}[path]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_include_goes_at_the_top_once_with_a_backup(home):
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o755)
    mine = "Host github.com\n    User git\n"
    (ssh / "config").write_text(mine)

    backup = sshfiles.ensure_include()

    text = (ssh / "config").read_text()
    assert text == f"Include config.d/*\n\n{mine}"
    assert backup.read_text() == mine and mode(backup) == 0o600
    assert mode(ssh) == 0o700 and mode(ssh / "config") == 0o600
    assert sshfiles.ensure_include() is None
    assert (ssh / "config").read_text() == text  # a second install changes nothing
    assert sorted(p.name for p in ssh.iterdir()) == ["config", "config.tpu-portal-backup"]


def test_a_missing_ssh_config_is_made_with_just_the_include(home):
    assert sshfiles.ensure_include() is None
    assert (home / ".ssh" / "config").read_text() == "Include config.d/*\n"
    assert mode(home / ".ssh" / "config") == 0o600


@pytest.mark.parametrize(
    "existing",
    [
        "Include config.d/*\nHost a\n",
        "# mine\ninclude ~/.ssh/config.d/*\n",
        "Include=config.d/tpu-portal\n",
    ],
)
def test_an_include_already_at_the_top_is_left_alone(home, existing):
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text(existing)
    assert sshfiles.ensure_include() is None
    assert (home / ".ssh" / "config").read_text() == existing


def test_an_include_inside_a_host_block_does_not_count(home):
    (home / ".ssh").mkdir()
    existing = "Host a\n    Include config.d/*\n"
    (home / ".ssh" / "config").write_text(existing)
    assert sshfiles.ensure_include() is not None
    assert (home / ".ssh" / "config").read_text().startswith("Include config.d/*\n\nHost a\n")


def test_refresh_writes_both_files_privately_and_only_when_something_changed(home):
    portal = Portal()
    first = sshfiles.refresh(portal)
    assert first.config_changed and first.known_hosts_changed
    config, known = paths.ssh_config_file(), paths.known_hosts_file()
    assert config == home / ".ssh" / "config.d" / "tpu-portal"
    assert known == home / ".ssh" / "tpu-portal_known_hosts"
    assert mode(config) == mode(known) == 0o600
    assert mode(config.parent) == mode(home / ".ssh") == 0o700

    # A new download differs only in its "generated" time: nothing is rewritten.
    portal.config = CONFIG.format(when="2026-01-01 10:05", w1="10.1.0.2")
    assert not sshfiles.refresh(portal).changed
    assert "10:00" in config.read_text()

    portal.config = CONFIG.format(when="2026-01-01 10:06", w1="10.9.9.9")
    again = sshfiles.refresh(portal)
    assert again.config_changed and not again.known_hosts_changed
    assert "HostName 10.9.9.9" in config.read_text()


def test_the_config_says_each_vms_hosts_addresses_and_user():
    tpu5, v2 = sshfiles.parse_config(CONFIG.format(when="x", w1="10.1.0.2"))
    assert (tpu5.lab, tpu5.name, tpu5.zone, tpu5.main, tpu5.user) == (
        "vision", "tpu5", None, "tpu5", "milo"
    )  # fmt: skip
    assert tpu5.hosts == {0: "tpu5-w0", 1: "tpu5-w1"}
    assert tpu5.addresses == {0: "10.1.0.1", 1: "10.1.0.2"}
    assert (v2.lab, v2.name, v2.zone, v2.hosts) == (
        "nlp", "v2", "us-central1-f", {0: "nlp-v2-us-central1-f"}
    )  # fmt: skip


def test_ssh_uses_the_persons_config_once_it_includes_the_portals(home):
    assert sshfiles.ssh_base() == ["ssh", "-F", str(paths.ssh_config_file())]
    sshfiles.ensure_include()
    assert sshfiles.ssh_base() == ["ssh"]


def test_a_vm_is_named_by_its_name_its_lab_and_name_or_its_ssh_host():
    from tpu_cli import vms
    from tpu_cli.errors import NOT_FOUND, USAGE, CliError

    configured = sshfiles.parse_config(CONFIG.format(when="x", w1="10.1.0.2"))
    known = vms.from_config(configured)
    assert vms.resolve(known, "tpu5").hosts() == {0: "tpu5-w0", 1: "tpu5-w1"}
    assert vms.resolve(known, "nlp/v2").label == "nlp/v2"
    assert vms.resolve(known, "nlp-v2-us-central1-f").name == "v2"
    with pytest.raises(CliError) as unknown:
        vms.resolve(known, "tpu9")
    assert unknown.value.code == NOT_FOUND
    assert unknown.value.message == (
        "You have no access to a TPU VM named tpu9. Yours: vision/tpu5, nlp/v2."
    )
    other = sshfiles.SshVm(lab="nlp", name="tpu5", zone=None, main="nlp-tpu5")
    other.hosts = {0: "nlp-tpu5"}
    twice = known + vms.from_config([other])
    with pytest.raises(CliError) as ambiguous:
        vms.resolve(twice, "tpu5")
    assert ambiguous.value.code == USAGE
    assert (
        ambiguous.value.message == "tpu5 is in more than one lab; say which: vision/tpu5, nlp/tpu5."
    )
    assert vms.resolve(twice, "nlp/tpu5").hosts() == {0: "nlp-tpu5"}

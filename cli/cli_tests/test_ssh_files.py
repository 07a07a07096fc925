"""The ssh files the client writes, in a temporary home: where the portal's page says,
with the Include line added once at the top of ~/.ssh/config and a backup, idempotent,
and private modes."""

from __future__ import annotations

import base64
import copy
import os
import stat
import struct
import subprocess

import pytest

from tpu_cli import paths, sshfiles


def host_key(seed: int) -> str:
    """A well-formed ed25519 public key line (type, base64 of the type and 32 bytes)."""
    kind = b"ssh-ed25519"
    blob = struct.pack(">I", len(kind)) + kind + struct.pack(">I", 32) + bytes([seed]) * 32
    return "ssh-ed25519 " + base64.b64encode(blob).decode()


KEY_A, KEY_B = host_key(1), host_key(2)


def answer(w1: str = "10.1.0.2", key: str = KEY_A) -> dict:
    """What /me/ssh-hosts answers: vision/tpu5, a 2-worker pod with a TensorBoard forward,
    and nlp/v2, whose lab has a v2 in two zones."""
    return {
        "username": "milo",
        "vms": [
            {"lab": "vision", "name": "tpu5", "zone": "us-central1-f", "host": "tpu5",
             "forward_agent": False, "forwards": [{"local": 16006, "remote": 6006}],
             "workers": [
                 {"index": 0, "address": "10.1.0.1", "alias": "tpu-portal.vision.tpu5.w0",
                  "host_keys": [key]},
                 {"index": 1, "address": w1, "alias": "tpu-portal.vision.tpu5.w1",
                  "host_keys": [KEY_B]},
             ]},
            {"lab": "nlp", "name": "v2", "zone": "us-central1-f", "host": "nlp-v2-us-central1-f",
             "forward_agent": True, "forwards": [],
             "workers": [
                 {"index": 0, "address": "10.2.0.1",
                  "alias": "tpu-portal.nlp.v2.us-central1-f.w0", "host_keys": []},
             ]},
        ],
    }  # fmt: skip


class Portal:
    """What /me/ssh-hosts answers."""

    url = "https://tpu.example.edu"

    def __init__(self):
        self.answer = answer()

    def get(self, path):
        assert path == "/me/ssh-hosts"
        return copy.deepcopy(self.answer)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def include(home) -> str:
    return f"Include {home}/.ssh/config.d/*"


def test_the_include_goes_at_the_top_once_with_a_backup(home):
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o755)
    mine = "Host github.com\n    User git\n"
    (ssh / "config").write_text(mine)

    backup = sshfiles.ensure_include()

    text = (ssh / "config").read_text()
    assert text == f"{include(home)}\n\n{mine}"
    assert backup.read_text() == mine and mode(backup) == 0o600
    assert mode(ssh) == 0o700 and mode(ssh / "config") == 0o600
    assert sshfiles.ensure_include() is None
    assert (ssh / "config").read_text() == text  # a second install changes nothing
    assert sorted(p.name for p in ssh.iterdir()) == ["config", "config.tpu-portal-backup"]


def test_a_missing_ssh_config_is_made_with_just_the_include(home):
    assert sshfiles.ensure_include() is None
    assert (home / ".ssh" / "config").read_text() == f"{include(home)}\n"
    assert mode(home / ".ssh" / "config") == 0o600


@pytest.mark.parametrize(
    "existing",
    [
        "Include {home}/.ssh/config.d/*\nHost a\n",
        "# mine\ninclude {home}/.ssh/config.d/tpu-portal\n",
        'Include="{home}/.ssh/config.d/*"\n',
    ],
)
def test_an_include_already_at_the_top_is_left_alone(home, existing):
    existing = existing.format(home=home)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text(existing)
    assert sshfiles.ensure_include() is None
    assert (home / ".ssh" / "config").read_text() == existing


@pytest.mark.parametrize("existing", ["Include config.d/*\n", "Include ~/.ssh/config.d/*\n"])
def test_a_relative_include_counts_only_where_ssh_reads_this_home(home, existing, monkeypatch):
    # ssh resolves it against the home in the password database: with $HOME elsewhere,
    # it reads another folder, so the absolute line goes on top of it.
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text(existing)
    assert sshfiles.ensure_include() is not None
    assert (home / ".ssh" / "config").read_text() == f"{include(home)}\n\n{existing}"
    # Where $HOME is the home in the password database, it is enough.
    (home / ".ssh" / "config").write_text(existing)
    monkeypatch.setattr(paths, "passwd_home", lambda: home)
    assert sshfiles.ensure_include() is None


def test_an_include_inside_a_host_block_does_not_count(home):
    (home / ".ssh").mkdir()
    existing = f"Host a\n    {include(home)}\n"
    (home / ".ssh" / "config").write_text(existing)
    assert sshfiles.ensure_include() is not None
    assert (home / ".ssh" / "config").read_text().startswith(f"{include(home)}\n\nHost a\n")


def test_refresh_writes_both_files_privately_and_only_when_something_changed(home):
    portal = Portal()
    first = sshfiles.refresh(portal)
    assert first.config_changed and first.known_hosts_changed
    config, known = paths.ssh_config_file(), paths.known_hosts_file()
    assert config == home / ".ssh" / "config.d" / "tpu-portal"
    assert known == home / ".ssh" / "tpu-portal_known_hosts"
    assert mode(config) == mode(known) == 0o600
    assert mode(config.parent) == mode(home / ".ssh") == 0o700
    assert known.read_text() == (
        f"tpu-portal.vision.tpu5.w0 {KEY_A}\ntpu-portal.vision.tpu5.w1 {KEY_B}\n"
    )

    assert not sshfiles.refresh(portal).changed  # the same answer: nothing rewritten

    portal.answer = answer(w1="10.9.9.9")
    again = sshfiles.refresh(portal)
    assert again.config_changed and not again.known_hosts_changed
    assert "HostName 10.9.9.9" in config.read_text()


def _effective(home, host: str) -> dict:
    """What ssh makes of ``host`` with the person's files."""
    found = subprocess.run([*sshfiles.ssh_base(), "-G", host], capture_output=True, text=True,
                           check=True, env={**os.environ, "HOME": str(home)})  # fmt: skip
    options = {}
    for line in found.stdout.splitlines():
        key, _, value = line.partition(" ")
        options.setdefault(key, []).append(value)
    return options


def test_the_client_writes_each_worker_as_ssh_should_reach_it(home):
    sshfiles.refresh(Portal())
    for host, address, alias in (
        ("tpu5", "10.1.0.1", "tpu-portal.vision.tpu5.w0"),
        ("tpu5-w1", "10.1.0.2", "tpu-portal.vision.tpu5.w1"),
        ("nlp-v2-us-central1-f", "10.2.0.1", "tpu-portal.nlp.v2.us-central1-f.w0"),
    ):
        found = _effective(home, host)
        assert found["hostname"] == [address] and found["hostkeyalias"] == [alias]
        assert found["user"] == ["milo"] and found["stricthostkeychecking"] == ["true"]
        assert found["userknownhostsfile"] == [str(home / ".ssh" / "tpu-portal_known_hosts")]
    assert _effective(home, "tpu5")["localforward"] == ["16006 [localhost]:6006"]
    assert "localforward" not in _effective(home, "tpu5-w1")
    assert _effective(home, "nlp-v2-us-central1-f")["forwardagent"] == ["yes"]
    assert _effective(home, "tpu5")["forwardagent"] == ["no"]


def test_the_config_has_host_blocks_of_known_keywords_only(home):
    sshfiles.refresh(Portal())
    keywords = set()
    for line in paths.ssh_config_file().read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            keywords.add(line.split()[0])
    assert keywords == {"Host", "HostName", "User", "HostKeyAlias", "UserKnownHostsFile",
                        "StrictHostKeyChecking", "ForwardAgent", "LocalForward"}  # fmt: skip


def _vm(data, index=0):
    return data["vms"][index]


def _worker(data, index=0):
    return data["vms"][0]["workers"][index]


HOSTILE = [
    ("a host name", lambda d: _vm(d).update(host="*"), "the host name of vision/tpu5"),
    ("a host name with a line", lambda d: _vm(d).update(host="tpu5\n    ProxyCommand sh -c x"),
     "the host name of vision/tpu5"),
    ("a host name with a space", lambda d: _vm(d).update(host="tpu5 *"), "the host name"),
    ("another host's name", lambda d: _vm(d).update(host="github.com"),
     "the host name of vision/tpu5 that is not valid: 'github.com'"),
    ("a zone of another form", lambda d: _vm(d).update(zone="x"), "the zone of vision/tpu5"),
    ("a lab name", lambda d: _vm(d).update(lab="vision\nHost *"), "a lab name"),
    ("an address with options",
     lambda d: _worker(d).update(address="10.1.0.1 -oProxyCommand=x"),
     "the address of tpu-portal.vision.tpu5.w0"),
    ("an address that is a name", lambda d: _worker(d).update(address="evil.example"),
     "the address of tpu-portal.vision.tpu5.w0"),
    ("an alias of another form", lambda d: _worker(d).update(alias="tpu-portal.x.y.w0"),
     "the host key alias of vision/tpu5 worker 0"),
    ("a host key with a line", lambda d: _worker(d).update(host_keys=[KEY_A + "\n* ssh-rsa AAAA"]),
     "a host key of tpu-portal.vision.tpu5.w0"),
    ("a host key of another type", lambda d: _worker(d).update(host_keys=["ssh-rsa" + KEY_A[11:]]),
     "a host key of tpu-portal.vision.tpu5.w0"),
    ("a host key that is not base64", lambda d: _worker(d).update(host_keys=["ssh-ed25519 AA!A"]),
     "a host key of"),
    ("a forward that is text",
     lambda d: _vm(d).update(forwards=[{"local": "6006 localhost:22\nProxyCommand x",
                                         "remote": 1}]), "a local port of vision/tpu5"),
    ("a forward out of range", lambda d: _vm(d).update(forwards=[{"local": 1, "remote": 70000}]),
     "a port of vision/tpu5"),
    ("a forward that is a bool", lambda d: _vm(d).update(forwards=[{"local": True, "remote": 1}]),
     "a local port"),
    ("agent forwarding as text", lambda d: _vm(d).update(forward_agent="yes"),
     "the agent forwarding of vision/tpu5"),
    ("a worker index as text", lambda d: _worker(d).update(index="0"), "a worker index"),
    ("a username with a line", lambda d: d.update(username="milo\n    ProxyCommand x"),
     "a unix username"),
    ("one worker twice", lambda d: _vm(d)["workers"].append(_worker(d, 1)),
     "a host key alias twice"),
    ("no list of VMs", lambda d: d.update(vms="Host *"), "the list of your VMs"),
]  # fmt: skip


@pytest.mark.parametrize("case, spoil, named", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_a_value_of_the_wrong_form_is_refused_and_nothing_is_written(home, case, spoil, named):
    from tpu_cli.errors import CliError

    portal = Portal()
    sshfiles.refresh(portal)
    config, known = paths.ssh_config_file(), paths.known_hosts_file()
    before = (config.read_text(), known.read_text())
    spoil(portal.answer)
    with pytest.raises(CliError) as refused:
        sshfiles.refresh(portal)
    assert named in refused.value.message
    assert "Nothing was written to your ssh files" in refused.value.message
    assert (config.read_text(), known.read_text()) == before


def test_an_answer_that_is_not_about_ssh_hosts_is_refused(home):
    from tpu_cli.errors import CliError

    portal = Portal()
    portal.answer = "Host *\n    ProxyCommand sh -c 'touch /tmp/owned'\n"
    with pytest.raises(CliError) as refused:
        sshfiles.refresh(portal)
    assert "an answer about your ssh hosts" in refused.value.message
    assert not paths.ssh_config_file().exists() and not paths.known_hosts_file().exists()


def test_the_config_says_each_vms_hosts_addresses_and_user(home):
    sshfiles.refresh(Portal())
    tpu5, v2 = sshfiles.read_config()
    assert (tpu5.lab, tpu5.name, tpu5.zone, tpu5.main, tpu5.user) == (
        "vision", "tpu5", None, "tpu5", "milo"
    )  # fmt: skip
    assert tpu5.hosts == {0: "tpu5-w0", 1: "tpu5-w1"}
    assert tpu5.addresses == {0: "10.1.0.1", 1: "10.1.0.2"}
    assert (v2.lab, v2.name, v2.zone, v2.hosts) == (
        "nlp", "v2", "us-central1-f", {0: "nlp-v2-us-central1-f"}
    )  # fmt: skip


def test_ssh_uses_the_persons_config_once_it_includes_the_portals(home, monkeypatch):
    assert sshfiles.ssh_base() == ["ssh", "-F", str(paths.ssh_config_file())]
    sshfiles.ensure_include()
    # $HOME (the test's folder) is not the home in the password database, which plain
    # ssh reads: the client names its config.
    assert sshfiles.ssh_base() == ["ssh", "-F", str(home / ".ssh" / "config")]
    monkeypatch.setattr(paths, "passwd_home", lambda: home)
    assert sshfiles.ssh_base() == ["ssh"]


def test_with_home_elsewhere_every_worker_resolves_through_the_persons_config(home):
    # OpenSSH reads ~/.ssh/config and resolves a relative Include in the home of the
    # password database; with $HOME elsewhere the client's ssh still finds every worker.
    mine = "Host github.com\n    User git\n"
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text(mine)
    sshfiles.refresh(Portal())
    sshfiles.ensure_include()
    assert _effective(home, "tpu5-w1")["hostname"] == ["10.1.0.2"]
    assert _effective(home, "github.com")["user"] == ["git"]


def test_a_vm_is_named_by_its_name_its_lab_and_name_or_its_ssh_host(home):
    from tpu_cli import vms
    from tpu_cli.errors import NOT_FOUND, USAGE, CliError

    sshfiles.refresh(Portal())
    configured = sshfiles.read_config()
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


def test_a_home_with_a_space_and_a_percent_sign_is_written_so_ssh_reads_it(tmp_path, monkeypatch):
    home = tmp_path / "my home%d"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    sshfiles.refresh(Portal())
    sshfiles.ensure_include()
    assert sshfiles.ensure_include() is None  # it sees its own quoted line
    found = _effective(home, "tpu5-w1")
    assert found["hostname"] == ["10.1.0.2"]
    assert found["userknownhostsfile"] == [str(home / ".ssh" / "tpu-portal_known_hosts")]

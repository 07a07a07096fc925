"""One ssh connection per worker, shared between the client's ssh and rsync sessions
and the next commands' (OpenSSH's ControlMaster): its sockets in a folder of the
person's own, 0700; left alone when the person's own config shares connections; never
used after the portal's files changed; closed at sign-out. The live connections
themselves are exercised against the sshd fleet in test_fleet_journey."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

import pytest

from cli_tests.test_ssh_files import KEY_B, Portal, answer
from tests.requirements import need
from tpu_cli import connections, sshfiles


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    # A short runtime folder, as the system gives: a socket's path has a length limit.
    runtime = Path(tempfile.mkdtemp(prefix="run-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    # The short folders' place: this test's own, as short as /tmp is for a person.
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    monkeypatch.setattr(connections, "TMP", short)
    sshfiles.refresh(Portal())
    yield tmp_path
    shutil.rmtree(runtime)
    shutil.rmtree(short)


def _long_runtime(monkeypatch) -> Path:
    """A runtime folder as long as /run/user/<a 10-digit uid>, or longer."""
    runtime = Path(tempfile.mkdtemp(prefix="run-user-1234567890-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _option(argv: list[str], name: str) -> str:
    return next(v.split("=", 1)[1] for v in argv if v.startswith(f"{name}="))


def test_the_workers_connections_are_shared_from_a_private_folder(home):
    ssh = sshfiles.ssh_base()
    argv = connections.shared(ssh, "tpu5")
    assert argv[: len(ssh)] == ssh
    assert _option(argv, "ControlMaster") == "auto"
    assert _option(argv, "ControlPersist") == str(connections.PERSIST_SECONDS)
    folder = Path(_option(argv, "ControlPath")).parent
    assert _option(argv, "ControlPath").endswith("/%C")
    base = Path(os.environ["XDG_RUNTIME_DIR"]) / "tpu-portal"
    assert folder.parent.parent == base
    for each in (base, folder.parent, folder):
        assert _mode(each) == 0o700 and each.lstat().st_uid == os.getuid()
    assert connections.shared(ssh, "tpu5-w1") == argv  # one folder for every worker


def test_the_persons_own_connection_sharing_is_left_as_it_is(home):
    own = home / "own_config"
    own.write_text("Host *\n    ControlMaster auto\n    ControlPath ~/.ssh/cm-%C\n")
    ssh = ["ssh", "-F", str(own)]
    assert connections.shared(ssh, "tpu5") == ssh


def test_a_socket_folder_someone_else_made_is_not_used(home):
    need(os.geteuid() == 0, "needs root to make a folder that another user owns")
    base = Path(os.environ["XDG_RUNTIME_DIR"]) / "tpu-portal"
    base.mkdir(mode=0o777)
    os.chown(base, 65534, 65534)
    ssh = sshfiles.ssh_base()
    fallback = connections.TMP / f"tpu-portal-{os.getuid()}"
    assert _folder(connections.shared(ssh, "tpu5")).parent.parent == fallback
    os.chown(base, 0, 0)
    base.rmdir()
    # Nor a link to a folder of the person's own, which someone could have placed.
    target = home / "elsewhere"
    target.mkdir(mode=0o700)
    base.symlink_to(target)
    assert _folder(connections.shared(ssh, "tpu5")).parent.parent == fallback
    assert not any(target.iterdir())


def _folder(argv: list[str]) -> Path:
    return Path(_option(argv, "ControlPath")).parent


def test_a_runtime_folder_too_long_for_a_socket_falls_back_to_a_short_private_one(
    home, monkeypatch, capsys
):
    runtime = _long_runtime(monkeypatch)
    try:
        argv = connections.shared(sshfiles.ssh_base(), "tpu5")
    finally:
        shutil.rmtree(runtime)
    folder = _folder(argv)
    base = connections.TMP / f"tpu-portal-{os.getuid()}"
    assert folder.parent.parent == base
    for each in (base, folder.parent, folder):
        assert _mode(each) == 0o700 and each.lstat().st_uid == os.getuid()
    # ssh's socket path, with %C (40) and the suffix it adds while it makes one (17).
    assert len(f"{folder}/{'c' * 40}.{'x' * 16}") < 104
    assert capsys.readouterr().err == ""


def test_a_short_folder_someone_else_took_gives_way_to_a_random_one_kept_for_next_time(
    home, monkeypatch
):
    need(os.geteuid() == 0, "needs root to make a folder that another user owns")
    runtime = _long_runtime(monkeypatch)
    taken = connections.TMP / f"tpu-portal-{os.getuid()}"
    taken.mkdir(mode=0o777)
    os.chown(taken, 65534, 65534)
    try:
        first = _folder(connections.shared(sshfiles.ssh_base(), "tpu5"))
        again = _folder(connections.shared(sshfiles.ssh_base(), "tpu5"))
    finally:
        shutil.rmtree(runtime)
    base = first.parent.parent
    assert base.parent == connections.TMP and base.name.startswith("tpu-") and base != taken
    assert _mode(base) == 0o700 and base.lstat().st_uid == os.getuid()
    assert again == first  # the next command shares the same connections
    assert not any(taken.iterdir())


def test_when_no_private_folder_can_be_had_the_person_is_told(home, monkeypatch, capsys):
    runtime = _long_runtime(monkeypatch)
    monkeypatch.setattr(connections, "TMP", Path("/proc/tpu"))  # nothing can be made there
    monkeypatch.setattr(connections, "_warned", False)
    try:
        ssh = sshfiles.ssh_base()
        assert connections.shared(ssh, "tpu5") == ssh
    finally:
        shutil.rmtree(runtime)
    err = capsys.readouterr().err
    assert "tpu: not sharing ssh connections between sessions" in err
    assert "is too long a path for a socket" in err


def test_a_changed_address_or_host_key_never_uses_an_earlier_connection(home):
    ssh = sshfiles.ssh_base()
    before = Path(_option(connections.shared(ssh, "tpu5"), "ControlPath")).parent
    # A connection that has ended leaves its socket behind.
    ended = socket.socket(socket.AF_UNIX)
    ended.bind(str(before / "ended"))
    ended.close()
    a_while_ago = time.time() - 120
    os.utime(before, (a_while_ago, a_while_ago))
    portal = Portal()
    portal.answer = answer(key=KEY_B)
    assert sshfiles.refresh(portal).known_hosts_changed
    after = Path(_option(connections.shared(ssh, "tpu5"), "ControlPath")).parent
    assert after != before and after.parent == before.parent
    assert not before.exists()  # its ended socket removed, then the folder


def test_a_folder_another_command_just_made_stays_while_it_opens_its_connections(home):
    # Another terminal's command, started before the files changed, made its folder a
    # moment ago and is about to open its connections there: this command's tidying
    # leaves it (its ssh would fail with "unix_listener: cannot bind").
    ssh = sshfiles.ssh_base()
    theirs = Path(_option(connections.shared(ssh, "tpu5"), "ControlPath")).parent
    portal = Portal()
    portal.answer = answer(key=KEY_B)
    assert sshfiles.refresh(portal).known_hosts_changed
    mine = Path(_option(connections.shared(ssh, "tpu5"), "ControlPath")).parent
    assert mine != theirs and theirs.is_dir()
    # Once it is older than a minute and still empty, the next command removes it.
    a_while_ago = time.time() - 120
    os.utime(theirs, (a_while_ago, a_while_ago))
    connections.shared(ssh, "tpu5")
    assert not theirs.exists() and mine.is_dir()


def test_signing_out_closes_the_connections_the_files_name_now(home):
    ssh = sshfiles.ssh_base()
    folder = Path(_option(connections.shared(ssh, "tpu5"), "ControlPath")).parent
    ended = socket.socket(socket.AF_UNIX)
    ended.bind(str(folder / "ended"))
    ended.close()
    connections.close_shared(ssh)
    assert not folder.parent.exists()

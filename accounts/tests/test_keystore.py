"""The key tests' keys: made once per run by the real ssh-keygen, however many test
processes ask, and waited for rather than timed out on a loaded machine."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from accounts.tests.keystore import KeyStore
from tests.requirements import need


@pytest.fixture
def counted_keygen(tmp_path, monkeypatch) -> Path:
    """An ``ssh-keygen`` first on the PATH that logs each run, waits a little (a slow
    machine), then runs the real one; the log's path."""
    real = shutil.which("ssh-keygen")
    need(real is not None, "ssh-keygen (openssh-client) is not installed")
    shim = tmp_path / "bin" / "ssh-keygen"
    shim.parent.mkdir()
    log = tmp_path / "runs.log"
    shim.write_text(f'#!/bin/sh\necho run >>"{log}"\nsleep 0.5\nexec "{real}" "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    return log


def test_a_key_is_made_once_however_many_processes_ask_for_it(tmp_path, counted_keygen):
    folder = tmp_path / "keys"
    folder.mkdir()
    stores = [KeyStore(folder) for _ in range(4)]  # as pytest-xdist's workers would
    found = []
    askers = [
        threading.Thread(
            target=lambda s=s: found.append(s.path("rsa-3072", "-t", "rsa", "-b", "3072", "-N", ""))
        )
        for s in stores
    ]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()

    assert counted_keygen.read_text().splitlines() == ["run"]
    assert len(set(found)) == 1 and found[0].with_suffix(".pub").exists()


def test_a_private_key_kind_is_made_once_per_run(tmp_path, counted_keygen):
    store = KeyStore(tmp_path)

    first = store.private_key("ed25519", "RFC4716", "correct horse")
    again = KeyStore(tmp_path).private_key("ed25519", "RFC4716", "correct horse")
    plain = store.private_key("ed25519", "RFC4716", "")

    assert first == again != plain
    assert "BEGIN OPENSSH PRIVATE KEY" in first
    assert len(counted_keygen.read_text().splitlines()) == 2

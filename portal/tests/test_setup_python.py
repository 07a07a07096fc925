"""bin/setup chooses the Python it makes .venv with: it says which one and how to
choose another, skips one that does not run, is not 3.11 or that the service user
cannot run, and when none will do, names every one it tried and why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.requirements import need

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3.11"


def setup_python(env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """``bin/setup python`` (only the choice) with ``env`` over a plain PATH."""
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    return subprocess.run(
        [str(ROOT / "bin" / "setup"), "python"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def fake_python(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def system_python():
    need(Path(SYSTEM_PYTHON).exists(), f"{SYSTEM_PYTHON} is not installed")
    return SYSTEM_PYTHON


def test_it_says_which_python_it_uses_and_how_to_choose(system_python, tmp_path):
    done = setup_python({}, tmp_path)

    assert done.returncode == 0, done.stderr
    version = subprocess.run(
        [system_python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == (
        f"setup: using {system_python} (Python {version}); set PYTHON=... to choose another"
    )


def test_a_python_that_does_not_run_is_skipped_with_the_reason(system_python, tmp_path):
    broken = fake_python(
        tmp_path / "first", "python3.11", 'echo "python3.11: Permission denied" >&2; exit 126'
    )

    done = setup_python({"PATH": f"{broken.parent}:/usr/bin:/bin"}, tmp_path)

    assert done.returncode == 0, done.stderr
    first, chosen = done.stdout.splitlines()[:2]
    assert first == f"setup: not using {broken}: cannot be run: python3.11: Permission denied"
    assert chosen.startswith(f"setup: using {system_python} (Python 3.11.")


def test_a_python_the_service_user_cannot_run_is_skipped(system_python, tmp_path):
    need(os.geteuid() == 0, "needs root, to run a Python as another user")
    need(shutil.which("setpriv") is not None, "setpriv (util-linux) is not installed")
    private = tmp_path / "private"  # as /root/.pyenv is to the service user
    private.mkdir(mode=0o700)
    (private / "python3.11").symlink_to(system_python)
    tmp_path.chmod(0o755)

    done = setup_python(
        {"PATH": f"{private}:/usr/bin:/bin", "PORTAL_SERVICE_USER": "nobody"}, tmp_path
    )

    assert done.returncode == 0, done.stderr
    first, chosen = done.stdout.splitlines()[:2]
    assert first.startswith(
        f"setup: not using {private}/python3.11: the service user nobody cannot run it: "
    )
    assert "Permission denied" in first
    assert chosen.startswith(f"setup: using {system_python} (Python 3.11.")


def test_when_no_python_will_do_every_one_tried_is_named_with_why(tmp_path):
    newer = fake_python(tmp_path / "bin", "python3.13", "echo 3.13.1")

    missing = setup_python({"PYTHON": str(tmp_path / "nowhere" / "python3.11")}, tmp_path)
    wrong = setup_python({"PYTHON": str(newer)}, tmp_path)

    assert missing.returncode == wrong.returncode == 1
    assert missing.stdout == wrong.stdout == ""
    assert missing.stderr.splitlines() == [
        f"setup: no Python 3.11 to use. (PYTHON={tmp_path}/nowhere/python3.11) Tried:",
        f"  {tmp_path}/nowhere/python3.11: no such file",
        "Install Debian's python3.11 and python3.11-venv, or set PYTHON=/path/to/python3.11.",
    ]
    assert f"  {newer}: it is Python 3.13.1, not 3.11" in wrong.stderr.splitlines()


def test_an_unknown_mode_is_refused():
    done = subprocess.run(
        [str(ROOT / "bin" / "setup"), "production"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "setup: unknown mode 'production' (run, test or python)"

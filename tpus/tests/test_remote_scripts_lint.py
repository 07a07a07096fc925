"""Every shell script the project ships passes shellcheck: the scripts the portal runs
as root on workers (as they travel, parts joined) and the test fleet's own."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tpus.remote import scripts

ROOT = Path(__file__).resolve().parents[2]
FLEET_SCRIPTS = sorted((ROOT / "testfleet").glob("*.sh"))


def shellcheck(args: list[str], body: bytes | None = None) -> subprocess.CompletedProcess:
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (bin/setup test installs it)")
        pytest.skip("shellcheck is not installed (bin/setup test installs it)")
    return subprocess.run(["shellcheck", *args], input=body, capture_output=True)


@pytest.mark.parametrize("script", scripts.shipped(), ids=lambda s: s.name)
def test_each_script_run_on_workers_is_shellcheck_clean_as_it_travels(script):
    done = shellcheck(["--shell=sh", "-"], script.body)
    assert done.returncode == 0, done.stdout.decode()


@pytest.mark.parametrize("path", FLEET_SCRIPTS, ids=lambda p: p.name)
def test_each_test_fleet_script_is_shellcheck_clean(path):
    done = shellcheck([str(path)])
    assert done.returncode == 0, done.stdout.decode()


def test_the_reconcile_script_travels_as_its_parts_joined_in_name_order():
    parts = scripts.parts("reconcile.sh")
    body = scripts.load("reconcile.sh").body
    assert [p.name for p in parts] == sorted(p.name for p in parts)
    assert len(parts) > 1
    assert body == b"".join(p.read_bytes() for p in parts)
    assert body.startswith(b"#!/bin/sh\n")
    assert len(body) <= scripts.MAX_SCRIPT_BYTES


def test_the_job_supervisors_kept_file_is_named_by_the_sha256_of_its_text():
    # A start writes the supervisor only when the file of that name is missing: a
    # changed text under the old name would leave workers running the old one.
    text = scripts.load("job-start.sh").body.decode()
    body = re.search(r"<<'SUPERVISOR'\n(.*?\n)SUPERVISOR\n", text, re.S)
    named = re.search(r"^SUPERVISE=\$RUN/supervise-([0-9a-f]{64})\.sh$", text, re.M)
    assert body and named
    assert named.group(1) == hashlib.sha256(body.group(1).encode()).hexdigest(), (
        "the supervisor's text changed: name its file by the new text's SHA-256"
    )

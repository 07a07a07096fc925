"""`tpu run` asks the portal whether it would queue the job before it copies the
workdir to any worker: a job the portal refuses costs no sync."""

from __future__ import annotations

import os
import stat

import pytest

from cli_tests.test_ssh_files import answer
from tpu_cli import errors, sshbuild
from tpu_cli.main import main

GRANT = {
    "id": 1, "vm": "tpu5", "vm_id": 5, "lab": "vision", "user": "milo@uni.example",
    "username": "milo", "state": "active", "zone": "us-central1-f", "vm_state": "READY",
    "workers_total": 2, "vm_workers": [{"index": 0, "internal_ip": "10.0.0.1"},
                                       {"index": 1, "internal_ip": "10.0.0.2"}],
}  # fmt: skip
REFUSAL = {
    "detail": "TPU_VISIBLE_CHIPS is set by the portal; leave it out.",
    "errors": {"env": ["TPU_VISIBLE_CHIPS is set by the portal; leave it out."]},
}


@pytest.fixture
def rsync_log(tmp_path, monkeypatch):
    """An ``rsync`` on PATH that notes each call (and says its version)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "rsync.log"
    script = folder / "rsync"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "rsync  version 3.2.7"; exit 0; fi\n'
        f'echo "$@" >> {log}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return log


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as ended:
        main(list(argv))
    return ended.value.code, capsys.readouterr().err


def test_a_job_the_portal_refuses_is_not_synced_to_any_worker(portal, rsync_log, tmp_path, capsys):
    portal.on("GET", "/me/grants", {"items": [GRANT], "next": None})
    portal.on("GET", "/me/ssh-hosts", answer())
    # As text too, for a client that would read it (the one before this check).
    built = sshbuild.build(answer(), portal.url, tmp_path / ".ssh" / "tpu-portal_known_hosts")
    portal.on("GET", "/me/ssh-config", built.config)
    portal.on("GET", "/me/known-hosts", built.known_hosts)
    portal.on("POST", "/labs/vision/vms/5/jobs/validate", REFUSAL, status=400)
    work = tmp_path / "proj"
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")

    code, err = _run(capsys, "run", "tpu5", "--workdir", str(work), "--env",
                     "TPU_VISIBLE_CHIPS=0", "--", "python3", "train.py")  # fmt: skip

    assert code == errors.USAGE
    assert "tpu: TPU_VISIBLE_CHIPS is set by the portal; leave it out." in err
    assert not rsync_log.exists()
    assert "POST /api/v1/labs/vision/vms/5/jobs" not in portal.paths_asked()
    [(_, _, sent)] = [a for a in portal.asked if a[1].endswith("/jobs/validate")]
    assert sent["env"] == ["TPU_VISIBLE_CHIPS=0"] and sent["cwd"] == "proj"

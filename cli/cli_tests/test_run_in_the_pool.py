"""`tpu run --type v4-8`: the job goes to the lab's pool (any free VM of the kind),
says why it waits, and refuses what does not go with a kind."""

from __future__ import annotations

import pytest

from cli_tests.test_run_checks_first import GRANT, _run
from cli_tests.test_ssh_files import answer
from tpu_cli import errors, pool
from tpu_cli.main import main

WAITING = {
    "id": 7, "vm_id": None, "vm": None, "lab": "vision", "state": "queued",
    "accelerator_type": "v4-8", "zones": ["us-central2-b"], "provisioning": "spot",
    "reason": "All 2 v4-8 in us-central2-b (spot) you may use are busy; 0 jobs before yours.",
    "url": "http://portal/labs/vision/jobs/7/",
}  # fmt: skip


@pytest.fixture
def lab(portal):
    portal.on("GET", "/me/grants", {"items": [GRANT], "next": None})
    portal.on("GET", "/me/ssh-hosts", answer())
    return portal


def test_a_job_for_any_free_v4_8_is_queued_in_the_lab_of_the_persons_vms(lab, capsys):
    lab.on("POST", "/labs/vision/jobs", WAITING, status=201)

    code, err = _run(capsys, "run", "--type", "v4-8", "--zone", "us-central2-b", "--spot",
                     "--venv", "~/venv", "--detach", "--", "python3", "train.py")  # fmt: skip

    assert code == 0
    assert "Job 7 queued for any free v4-8 of vision: http://portal/labs/vision/jobs/7/" in err
    [(_, _, sent)] = [a for a in lab.asked if a[:2] == ("POST", "/api/v1/labs/vision/jobs")]
    assert sent["accelerator_type"] == "v4-8" and sent["zones"] == ["us-central2-b"]
    assert sent["provisioning"] == "spot" and sent["args"] == ["python3", "train.py"]


def test_it_says_why_the_job_waits_until_it_ends_without_a_vm(lab, capsys, monkeypatch):
    monkeypatch.setattr(pool, "WAIT_SECONDS", 0)
    lab.on("POST", "/labs/vision/jobs", WAITING, status=201)
    lab.on("GET", "/labs/vision/jobs/7", {**WAITING, "state": "cancelled", "reason": ""})

    code, err = _run(capsys, "run", "--type", "v4-8", "--lab", "vision", "--", "python3", "x.py")

    assert code == errors.FAILED
    assert f"Waiting: {WAITING['reason']}" in err
    assert "Job 7 cancelled before a VM took it." in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["run", "tpu5", "--type", "v4-8"], "Name the VM"),
        (["run"], "Name the VM"),
        (["run", "tpu5", "--spot"], "go with --type"),
    ],
)
def test_what_does_not_go_with_a_kind_is_refused_before_the_portal_is_asked(
    lab, capsys, argv, words
):
    code, err = _run(capsys, *argv, "--", "python3", "train.py")
    assert code == errors.USAGE and words in err
    assert not [a for a in lab.asked if a[0] == "POST"]


def test_tpu_jobs_lists_a_job_waiting_for_any_v4_8_and_why(lab, capsys):
    lab.on("GET", "/labs/vision/vms/5/jobs", {"items": [], "next": None})
    row = {**WAITING, "user": "milo@uni.example", "username": "milo",
           "command": "python3 train.py", "queued_at": "2026-11-28T16:00:00Z"}  # fmt: skip
    lab.on("GET", "/labs/vision/jobs", [row])

    with pytest.raises(SystemExit) as ended:
        main(["jobs"])
    said = capsys.readouterr()
    out = said.out + said.err
    assert ended.value.code == 0
    assert "vision/any v4-8" in out
    assert f"Job 7 (any v4-8): {WAITING['reason']}" in out


def test_a_job_past_the_labs_waiting_limit_is_refused_in_the_portals_words(lab, capsys):
    words = (
        "You already have 3 jobs waiting in Vision Lab; this lab allows 3 waiting at once "
        "per person. Cancel one or wait for one to start."
    )
    lab.on("POST", "/labs/vision/jobs", {"detail": words, "errors": {}}, status=400)

    code, err = _run(capsys, "run", "--type", "v4-8", "--detach", "--", "python3", "train.py")

    assert code != 0 and words in err
    assert "queued" not in err
    assert not [a for a in lab.asked if a[0] == "GET" and a[1].startswith("/api/v1/labs/")]

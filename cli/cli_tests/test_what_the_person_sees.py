"""What the commands show: another person's job log without the escape sequences that
would act on the reader's terminal; each VM's state in `tpu ls`; progress bars only on
a terminal; `tpu auth status`."""

from __future__ import annotations

import json

import pytest

from cli_tests.test_run_checks_first import GRANT, rsync_log  # noqa: F401 (a fixture)
from cli_tests.test_ssh_files import answer
from tpu_cli import errors, paths, sshbuild
from tpu_cli.main import main
from tpu_cli.terminal import clean_line

HOSTILE_LOG = (
    "\x1b]0;you have been logged out\x07step 1 \x1b[31mloss\x1b[0m 0.5\n"
    "\x1b[2J\x1b[Hstep 2\tok\r\n"
    "\x1b]52;c;cm0gLXJmIH4K\x07copied\n"
    "progress 10%\rprogress 100%\n"
    "\x9b31mbyte\x9dx\x9c \u202eevil\x00\x07\n"
    "\x1bP+q544e\x1b\\done"
)


def run(capsys, *argv):
    with pytest.raises(SystemExit) as ended:
        main(list(argv))
    captured = capsys.readouterr()
    return ended.value.code, captured.out, captured.err


def _vm_scene(portal, **grant):
    portal.on("GET", "/me/grants", {"items": [{**GRANT, **grant}], "next": None})
    portal.on("GET", "/me/ssh-hosts", answer())
    # As text too, for a client that would read it (the one before these changes).
    built = sshbuild.build(answer(), portal.url, paths.known_hosts_file())
    portal.on("GET", "/me/ssh-config", built.config)
    portal.on("GET", "/me/known-hosts", built.known_hosts)


def test_another_persons_log_is_shown_without_its_escape_sequences(portal, capsys):
    _vm_scene(portal)
    portal.on("GET", "/me/jobs/42", {"detail": "Not Found"}, status=404)
    job = {"id": 42, "vm_id": 5, "lab": "vision", "state": "succeeded", "user": "ana@uni.example",
           "parts": [{"index": 0}]}  # fmt: skip
    portal.on("GET", "/labs/vision/vms/5/jobs/42", job)
    portal.on("GET", "/labs/vision/vms/5/jobs/42/workers/0/log", HOSTILE_LOG)

    code, out, err = run(capsys, "logs", "42")

    assert code == 0, err
    assert out.splitlines() == [
        "step 1 loss 0.5", "step 2\tok", "copied", "progress 100%", "byte evil", "done"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "line, shown",
    [("\x1b[1;32mgreen\x1b[m", "green"), ("a\x1b7b\x1b8c", "abc"), ("\x1b]8;;http://x\x1b\\l", "l"),
     ("tab\there", "tab\there"), ("\x1b", ""), ("\rhalf", "half")],
)  # fmt: skip
def test_each_kind_of_sequence_is_removed(line, shown):
    assert clean_line(line) == shown


def test_ls_shows_each_vms_state(portal, capsys):
    _vm_scene(portal, vm_state="PREEMPTED")
    portal.on("GET", "/labs/vision/usage/now", {"items": [], "next": None})
    code, out, err = run(capsys, "ls")
    assert code == 0, err
    header, row = out.splitlines()[:2]
    assert header.split()[:4] == ["VM", "ACCESS", "STATE", "TPU"]
    assert row.split()[:3] == ["vision/tpu5", "active", "PREEMPTED"]


def _now_row(chips) -> dict:
    return {"items": [{"vm_id": GRANT["vm_id"], "state": "running", "job": None, "holders": [],
                       "queue_length": 0, "chips": chips}], "next": None}  # fmt: skip


def test_ls_shows_each_vms_chips_in_one_line(portal, capsys):
    _vm_scene(portal)
    summary = {"chips": 4, "hbm_used_bytes": 12 * 2**30, "hbm_total_bytes": 32 * 2**30,
               "duty_cycle_percent": 85.2}  # fmt: skip
    portal.on("GET", "/labs/vision/usage/now", _now_row({"summary": summary, "workers": []}))
    code, out, err = run(capsys, "ls")
    assert code == 0, err
    assert "vision/tpu5: HBM 12/32 GiB, duty 85%" in out.splitlines()


@pytest.mark.parametrize(
    "summary",
    [None, {"hbm_used_bytes": "[red]x", "hbm_total_bytes": 1, "duty_cycle_percent": 1},
     {"hbm_used_bytes": 5, "hbm_total_bytes": 1, "duty_cycle_percent": 1},
     {"hbm_used_bytes": 1, "hbm_total_bytes": 2, "duty_cycle_percent": 400}],
)  # fmt: skip
def test_ls_shows_no_chips_line_for_a_summary_that_is_missing_or_makes_no_sense(
    portal, capsys, summary
):
    _vm_scene(portal)
    portal.on("GET", "/labs/vision/usage/now", _now_row({"summary": summary, "workers": []}))
    code, out, err = run(capsys, "ls", "--json")
    assert code == 0, err
    [row] = json.loads(out)
    assert row["chips"] == ""


def test_ls_says_which_vms_come_from_a_grant_of_every_vm_of_a_kind(portal, capsys, monkeypatch):
    from tpu_cli import session

    monkeypatch.setattr(session.out, "width", 200)  # wide enough for one line a VM
    _vm_scene(portal, from_kind="v4-8")
    portal.on("GET", "/labs/vision/usage/now", {"items": [], "next": None})
    code, out, err = run(capsys, "ls")
    assert code == 0, err
    assert out.splitlines()[1].split()[:4] == ["vision/tpu5", "active", "(any", "v4-8)"]
    code, out, err = run(capsys, "ls", "--json")
    assert json.loads(out)[0]["from_kind"] == "v4-8"


def test_a_sync_into_a_log_file_has_no_progress_bars(portal, rsync_log, tmp_path, capsys):  # noqa: F811
    _vm_scene(portal)
    portal.on("POST", "/labs/vision/vms/5/jobs/validate", {"ok": True, "detail": "ok"})
    portal.on("POST", "/labs/vision/vms/5/jobs", {"id": 7, "url": "http://x/7"}, status=201)
    work = tmp_path / "proj"
    work.mkdir()
    code, out, err = run(capsys, "run", "tpu5", "--workdir", str(work), "--detach", "--", "true")
    assert code == 0, err
    assert len(rsync_log.read_text().splitlines()) == 2  # one rsync per worker
    assert "sync w0" not in err and "━" not in err
    assert f"Synced {work} to ~/proj on 2 worker(s)" in err


def test_auth_status_says_where_as_whom_until_when_and_that_the_token_works(portal, capsys):
    portal.on("GET", "/tokens", {"items": [
        {"id": 3, "hint": "tpp_other", "revoked_at": None},
        {"id": 4, "hint": "tpp_te", "revoked_at": None, "expires": "2027-02-01T00:00:00Z"},
    ], "next": None})  # fmt: skip
    code, out, err = run(capsys, "auth", "status")
    assert code == 0, err
    assert out.splitlines() == [
        f"Portal:        {portal.url}",
        "Signed in as:  milo@uni.example",
        out.splitlines()[2],
        "Expires:       2027-02-01T00:00:00Z",
    ]
    assert out.splitlines()[2].startswith("Token:         works")
    code, out, _ = run(capsys, "auth", "status", "--json")
    assert json.loads(out)["works"] is True and json.loads(out)["expires"] == "2027-02-01T00:00:00Z"


def test_auth_status_says_when_the_token_no_longer_works(portal, capsys):
    portal.on("GET", "/me", {"detail": "Unauthorized"}, status=401)
    code, out, err = run(capsys, "auth", "status")
    assert code == errors.SIGNED_OUT
    assert "Token:         no longer works; run `tpu login` again" in out


def test_auth_status_without_a_sign_in(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, err = run(capsys, "auth", "status")
    assert code == errors.SIGNED_OUT and "You are not signed in" in err


def test_what_a_worker_said_about_a_failed_job_is_cleaned_too():
    from tpu_cli import follow

    job = {"reason": "w0 failed\x1b]0;pwned\x07", "parts": [{"index": 0, "error": "\x1b[2Jboom"}]}
    assert follow.why(job) == ["w0 failed", "  w0: boom"]

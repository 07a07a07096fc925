"""Bad input is refused before anything is sent or synced: a clear message on stderr
and an exit code that says what went wrong."""

from __future__ import annotations

import json
import stat

import pytest

from tpu_cli import credentials, errors
from tpu_cli.main import main


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("TPU_PORTAL_CONFIG_DIR", raising=False)
    return tmp_path


def run(capsys, *argv):
    with pytest.raises(SystemExit) as ended:
        main(list(argv))
    return ended.value.code, capsys.readouterr().err


def test_a_workdir_that_does_not_exist_is_refused(capsys, home):
    code, err = run(capsys, "run", "tpu5", "--workdir", str(home / "nope"), "--", "true")
    assert code == errors.USAGE
    assert f"The workdir {home / 'nope'} does not exist" in err


def test_run_needs_a_command(capsys):
    code, err = run(capsys, "run", "tpu5")
    assert code == errors.USAGE and "Give the command after `--`" in err


def test_an_env_without_a_value_is_refused(capsys):
    code, err = run(capsys, "run", "tpu5", "--env", "XLA_FLAGS", "--", "true")
    assert code == errors.USAGE and "--env takes NAME=value, not 'XLA_FLAGS'" in err


@pytest.mark.parametrize("port", ["abc", "70000", "6006:0"])
def test_a_bad_port_is_refused(capsys, port):
    code, err = run(capsys, "forward", "tpu5", port)
    assert code == errors.USAGE and "port" in err.lower()


def test_a_command_without_a_sign_in_says_to_log_in(capsys):
    code, err = run(capsys, "ls")
    assert code == errors.SIGNED_OUT and "run `tpu login URL` first" in err


def test_an_unknown_command_or_option_is_a_usage_error(capsys):
    assert run(capsys, "fly")[0] == 2
    assert run(capsys, "ls", "--colour")[0] == 2


def test_a_job_is_named_by_its_number(capsys, home):
    credentials.save(credentials.SignIn("http://127.0.0.1:9", "tpp_x", "m@x"))
    code, err = run(capsys, "logs", "tpu5")
    assert code == errors.USAGE and "A job is named by its number" in err


def test_an_unreachable_portal_says_so(capsys, home):
    credentials.save(credentials.SignIn("http://127.0.0.1:9", "tpp_x", "m@x"))
    code, err = run(capsys, "ls")
    assert code == errors.UNREACHABLE and "Cannot reach http://127.0.0.1:9" in err


def test_the_sign_in_is_kept_private_in_the_config_dir(home):
    where = credentials.save(credentials.SignIn("https://p.example", "tpp_x", "m@x"))
    assert where == home / ".config" / "tpu-portal" / "credentials.json"
    assert stat.S_IMODE(where.stat().st_mode) == 0o600
    assert stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    assert json.loads(where.read_text())["token"] == "tpp_x"


def test_logout_with_an_unreachable_portal_still_forgets_the_token(capsys, home):
    credentials.save(credentials.SignIn("http://127.0.0.1:9", "tpp_x", "m@x"))
    code, err = run(capsys, "logout")
    assert code == errors.FAILED
    assert "Could not reach" in err and "stays valid until you revoke it" in err
    assert credentials.load() is None


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_name_every_command(capsys, shell):
    with pytest.raises(SystemExit) as ended:
        main(["completion", shell])
    assert ended.value.code == 0
    script = capsys.readouterr().out
    for command in ("login", "run", "exec", "forward", "usage"):
        assert command in script


def test_a_worker_is_a_number_or_all(capsys):
    code, err = run(capsys, "run", "tpu5", "--worker", "last", "--", "true")
    assert code == errors.USAGE
    assert "--worker takes a worker's number (0, 1, …) or all, not 'last'." in err

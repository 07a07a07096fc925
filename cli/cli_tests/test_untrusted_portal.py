"""Whoever answers at the portal's address cannot take over the person's ssh: the
client writes the ssh config itself from checked values and never copies the portal's
text; a portal over plain http is refused unless it is on this machine; a redirect is
followed within the portal's own origin or explained, never a traceback."""

from __future__ import annotations

import io
import os
import subprocess

import pytest

from cli_tests.test_ssh_files import answer
from tpu_cli import errors, paths
from tpu_cli.api import normal_url
from tpu_cli.main import main

MINE = "Host github.com\n    User git\n"


def run(capsys, *argv):
    with pytest.raises(SystemExit) as ended:
        main(list(argv))
    captured = capsys.readouterr()
    return ended.value.code, captured.err


def effective(host: str) -> dict:
    """What the person's own ssh (their ~/.ssh/config) makes of ``host``."""
    found = subprocess.run(["ssh", "-G", "-F", str(paths.ssh_dir() / "config"), host],
                           capture_output=True, text=True, check=True,
                           env={**os.environ})  # fmt: skip
    return dict(line.partition(" ")[::2] for line in found.stdout.splitlines())


def _mine(home):
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "config").write_text(MINE)


def test_a_portal_that_serves_a_proxycommand_changes_nothing_in_the_persons_ssh(
    portal,
    capsys,
    tmp_path,
):
    _mine(tmp_path)
    marker = tmp_path / "owned"
    hostile = f"Host *\n    ProxyCommand sh -c 'touch {marker}'\n"
    portal.on("GET", "/me/ssh-config", hostile)
    portal.on("GET", "/me/known-hosts", "")
    data = answer()
    data["vms"][0]["host"] = "*"
    portal.on("GET", "/me/ssh-hosts", data)

    code, err = run(capsys, "config", "install")

    assert code == errors.UNREACHABLE
    assert "The portal sent the host name of vision/tpu5 that is not valid: '*'." in err
    assert "Traceback" not in err
    assert (tmp_path / ".ssh" / "config").read_text() == MINE
    assert not paths.ssh_config_file().exists()
    assert effective("github.com").get("proxycommand", "none") == "none"
    assert not marker.exists()


def test_the_config_is_written_from_the_portals_data_not_its_text(
    portal,
    capsys,
    tmp_path,
):
    _mine(tmp_path)
    portal.on("GET", "/me/ssh-config", "Host *\n    ProxyCommand sh -c 'touch /tmp/x'\n")
    portal.on("GET", "/me/ssh-hosts", answer())

    code, err = run(capsys, "config", "install")

    assert code == 0, err
    assert "GET /api/v1/me/ssh-config" not in portal.paths_asked()
    text = (tmp_path / ".ssh" / "config").read_text()
    assert text.endswith(MINE) and "ProxyCommand" not in paths.ssh_config_file().read_text()
    assert effective("tpu5-w1")["hostname"] == "10.1.0.2"
    assert effective("anything.example").get("proxycommand", "none") == "none"
    # $HOME is not the home ssh reads here: the client says how to reach the host.
    assert f"`ssh -F {tmp_path}/.ssh/config tpu5` works" in err


def test_a_portal_without_the_hosts_data_is_named_and_nothing_is_written(
    portal,
    capsys,
    tmp_path,
):
    _mine(tmp_path)
    portal.on("GET", "/me/ssh-config", "Host tpu5\n    HostName 10.0.0.1\n")
    code, err = run(capsys, "config", "install")
    assert code == errors.UNREACHABLE
    assert "does not describe your ssh hosts (/api/v1/me/ssh-hosts)" in err
    assert (tmp_path / ".ssh" / "config").read_text() == MINE


@pytest.mark.parametrize(
    "url",
    [
        "http://tpu.example.edu",
        "http://tpu.example.edu/portal",
        "http://10.0.0.5:8000",
        "http://[::2]",
    ],
)
def test_a_portal_over_plain_http_elsewhere_than_this_machine_is_refused(url):
    with pytest.raises(errors.CliError) as refused:
        normal_url(url)
    assert refused.value.code == errors.USAGE


def test_plain_http_names_the_https_address_to_use(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("tpp_x\n"))
    code, err = run(capsys, "login", "--with-token", "http://tpu.example.edu")
    assert code == errors.USAGE
    assert "http://tpu.example.edu is not encrypted" in err
    assert "Use https://tpu.example.edu" in err


@pytest.mark.parametrize(
    "url", ["http://localhost:8000", "http://127.0.0.1:8000", "http://127.1.2.3", "http://[::1]:80"]
)
def test_plain_http_on_this_machine_is_accepted(url):
    assert normal_url(url) == url


def test_a_redirect_within_the_portal_is_followed(portal, capsys):
    portal.on("GET", "/me/ssh-hosts", "", status=308, Location="/api/v1/me/ssh-hosts/")
    portal.on("GET", "/me/ssh-hosts/", answer())
    code, err = run(capsys, "config", "install")
    assert code == 0, err
    assert portal.paths_asked()[-1] == "GET /api/v1/me/ssh-hosts/"


def test_a_redirect_elsewhere_is_explained_and_not_followed(portal, capsys):
    portal.on("GET", "/me/ssh-hosts", "", status=301,
              Location="https://tpu.example.edu/api/v1/me/ssh-hosts")  # fmt: skip
    code, err = run(capsys, "config", "install")
    assert code == errors.UNREACHABLE
    assert (
        f"tpu: The portal at {portal.url} redirects to https://tpu.example.edu/api/v1/me/ssh-hosts;"
        " use https://tpu.example.edu as the portal address (tpu login https://tpu.example.edu)."
    ) in err
    assert "Traceback" not in err


def test_an_answer_that_is_not_the_portals_api_is_explained(portal, capsys):
    portal.on("GET", "/me/ssh-hosts", b"<html>Sign in to the hotel wifi</html>")
    code, err = run(capsys, "config", "install")
    assert code == errors.UNREACHABLE
    assert "with something that is not the portal's API (text/plain, not JSON)" in err


def test_a_next_page_link_never_takes_the_token_to_another_host(portal, capsys):
    elsewhere = "http://elsewhere.example/api/v1/me/grants2?cursor=2"
    portal.on("GET", "/me/grants", {"items": [], "next": elsewhere})
    portal.on("GET", "/me/grants2", {"items": [], "next": None})
    portal.on("GET", "/me/ssh-hosts", answer())
    code, err = run(capsys, "ls")
    assert code == 0, err
    assert "GET /api/v1/me/grants2" in portal.paths_asked()


def test_a_list_that_is_not_a_list_is_explained(portal, capsys):
    portal.on("GET", "/me/grants", {"detail": "maintenance"})
    portal.on("GET", "/me/ssh-hosts", answer())
    code, err = run(capsys, "ls")
    assert code == errors.UNREACHABLE
    assert "answered /me/grants with something that is not a list of the portal's API" in err
    assert "Traceback" not in err


def test_a_sign_in_to_a_plain_http_portal_elsewhere_can_still_be_forgotten(
    capsys, tmp_path, monkeypatch
):
    from tpu_cli import credentials

    monkeypatch.setenv("HOME", str(tmp_path))
    credentials.save(credentials.SignIn(url="http://tpu.example.edu", token="t", email="m@x"))
    code, err = run(capsys, "ls")
    assert code == errors.USAGE and "http://tpu.example.edu is not encrypted" in err
    code, err = run(capsys, "logout")
    assert code == errors.FAILED and "the token was not revoked" in err
    assert credentials.load() is None

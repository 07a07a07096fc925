"""Production settings: `check --deploy` is clean, missing values fail loudly, and the
README's production steps serve the portal."""

from __future__ import annotations

import http.client
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.e2e import free_port
from tests.requirements import need

ROOT = Path(__file__).resolve().parents[2]

PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "portal.settings.production",
    "SECRET_KEY": "q8Zr!v2#Lm9@xT4$wN7&kP1^bH6*cJ3(eF5)gD0_aS8-uY2+iO4=zR7~tE9",
    "ALLOWED_HOSTS": "portal.example.org",
    "SITE_URL": "https://portal.example.org",
    "DATABASE_URL": "postgres://portal@127.0.0.1:5432/portal",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
    "CACHE_URL": "redis://127.0.0.1:6379/1",
    "EMAIL_URL": "smtp://portal:secret@mail.example.org:587?starttls=1",
    "PORTAL_SECRETS_KEY": "kZ3xq2Vb9mT4rW7yP1nL6cJ8hF5dS0aG2eQ4uI9oK3M=",
    "PORTAL_REMOTE_ALLOWED_NETWORKS": "10.128.0.0/9,34.0.0.0/8",
}


def _clean_environ() -> dict[str, str]:
    """This process's environment without anything that would configure the portal."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "PORTAL_", "STATIC_")) and k != "WEB_CONCURRENCY"
    }


def _manage(*args, env):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**_clean_environ(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def collected_static(tmp_path_factory) -> str:
    """A STATIC_ROOT that `collectstatic` has filled with production settings."""
    root = tmp_path_factory.mktemp("static")
    result = _manage("collectstatic", "--noinput", env={**PRODUCTION_ENV, "STATIC_ROOT": str(root)})
    assert result.returncode == 0, result.stdout + result.stderr
    return str(root)


def test_check_deploy_is_clean_with_production_settings(collected_static):
    env = {**PRODUCTION_ENV, "STATIC_ROOT": collected_static}
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_fails_when_the_portal_may_ssh_anywhere():
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "PORTAL_REMOTE_ALLOWED_NETWORKS"}
    result = _manage("check", "--deploy", env=env)
    assert result.returncode != 0
    assert "tpus.E001" in result.stderr
    assert "PORTAL_REMOTE_ALLOWED_NETWORKS is empty" in result.stderr


def test_check_deploy_fails_when_the_allowed_networks_span_every_address():
    env = {**PRODUCTION_ENV, "PORTAL_REMOTE_ALLOWED_NETWORKS": "10.0.0.0/8,0.0.0.0/0"}
    result = _manage("check", "--deploy", env=env)
    assert result.returncode != 0
    assert "tpus.E003" in result.stderr


def test_an_allowed_network_that_is_not_a_cidr_fails_every_check():
    env = {**PRODUCTION_ENV, "PORTAL_REMOTE_ALLOWED_NETWORKS": "10.0.0.1/8"}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert "'10.0.0.1/8' is not a network in CIDR form" in result.stderr


def test_production_refuses_to_start_without_a_secret_key():
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "SECRET_KEY"}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


def test_production_refuses_plain_http():
    result = _manage("check", env={**PRODUCTION_ENV, "SITE_URL": "http://portal.example.org"})
    assert result.returncode != 0
    assert "https://" in result.stderr


def test_production_reads_the_secret_key_from_a_file(tmp_path, collected_static):
    key = tmp_path / "secret"
    key.write_text(PRODUCTION_ENV["SECRET_KEY"] + "\n")
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "SECRET_KEY"}
    env.update(SECRET_KEY_FILE=str(key), STATIC_ROOT=collected_static)
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode == 0, result.stderr


def test_production_refuses_to_start_without_a_secrets_key():
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "PORTAL_SECRETS_KEY"}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert "PORTAL_SECRETS_KEY" in result.stderr


def test_production_refuses_a_secrets_key_that_is_not_a_fernet_key():
    result = _manage("check", env={**PRODUCTION_ENV, "PORTAL_SECRETS_KEY": "hunter2"})
    assert result.returncode != 0
    assert "Fernet key" in result.stderr


def test_check_deploy_refuses_until_collectstatic_has_written_the_manifest(tmp_path):
    env = {**PRODUCTION_ENV, "STATIC_ROOT": str(tmp_path / "static")}
    refused = _manage("check", "--deploy", env=env)
    assert refused.returncode != 0
    assert "portal.E001" in refused.stderr
    assert str(tmp_path / "static" / "staticfiles.json") in refused.stderr
    assert "collectstatic --noinput" in refused.stderr

    # The check does not stand in the way of the command that fixes it.
    collected = _manage("collectstatic", "--noinput", env=env)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    accepted = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


def test_check_deploy_refuses_a_manifest_it_cannot_read(tmp_path):
    (tmp_path / "staticfiles.json").write_text("{not json")
    result = _manage("check", "--deploy", env={**PRODUCTION_ENV, "STATIC_ROOT": str(tmp_path)})
    assert result.returncode != 0
    assert "portal.E002" in result.stderr


# --- The README's production steps, run as written -----------------------------------

PROXY_HEADERS = {"Host": PRODUCTION_ENV["ALLOWED_HOSTS"], "X-Forwarded-Proto": "https"}


def _readme_production_steps() -> list[list[str]]:
    """The commands in the README's Production section, split as the shell would."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Production\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    return [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]


def _reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or default_port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def production_services():
    """A throwaway PostgreSQL database and a Redis database and key prefix of its own,
    on the servers the services test run uses; dropped and deleted afterwards."""
    import psycopg
    import redis
    from psycopg import sql

    server = urlsplit(
        os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tpu_portal")
    )
    redis_url = urlsplit(os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    redis_url = redis_url._replace(path="/11").geturl()
    need(
        _reachable(server.geturl(), 5432) and _reachable(redis_url, 6379),
        f"PostgreSQL ({server.netloc}) and Redis ({redis_url}) must both be running",
    )
    name = f"tpu_portal_deploy_{secrets.token_hex(4)}"
    admin_url = server._replace(path="/postgres").geturl()
    with psycopg.connect(admin_url, autocommit=True) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield {
            "DATABASE_URL": server._replace(path=f"/{name}").geturl(),
            "CELERY_BROKER_URL": redis_url,
            "CACHE_URL": redis_url,
            "CACHE_KEY_PREFIX": name,
        }
    finally:
        with psycopg.connect(admin_url, autocommit=True) as connection:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            connection.execute(drop.format(sql.Identifier(name)))
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{name}:*"))
        if keys:
            client.delete(*keys)


def _get(port: int, path: str) -> tuple[int, http.client.HTTPMessage, bytes]:
    """A request as the TLS proxy in front of gunicorn would pass it on."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path, headers=PROXY_HEADERS)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def _wait_until_serving(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, f"gunicorn exited:\n{log.read_text()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"gunicorn did not listen on {port} within 60 s:\n{log.read_text()}")


def _stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_the_readme_production_steps_serve_the_login_page_and_its_stylesheet(
    tmp_path, production_services
):
    steps = _readme_production_steps()
    # Every kind of line the section has is known here: a new kind of step must be
    # taught to this test, not silently skipped.
    assert {words[0] for words in steps} <= {
        "bin/setup",
        ".",
        "export",
        "python",
        "gunicorn",
        "celery",
    }
    exported = {w.split("=", 1)[0] for s in steps if s[0] == "export" for w in s[1:]}
    assert "STATIC_ROOT" in exported
    [gunicorn] = [words[1:] for words in steps if words[0] == "gunicorn"]

    # bin/setup and activating .venv made this interpreter; the environment is the
    # operator's, with everything in this test's temporary directory.
    static_root = tmp_path / "static"
    env = {
        **_clean_environ(),
        **PRODUCTION_ENV,
        **production_services,
        "STATIC_ROOT": str(static_root),
        "PORTAL_VAR_DIR": str(tmp_path / "var"),
    }
    for words in steps:
        if words[:2] == ["python", "manage.py"]:
            result = subprocess.run(
                [sys.executable, *words[1:]],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, f"{shlex.join(words)}:\n{result.stdout}{result.stderr}"
    assert (static_root / "staticfiles.json").is_file()

    port = free_port()
    out, err = tmp_path / "gunicorn.out", tmp_path / "gunicorn.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "gunicorn"), *gunicorn],
            cwd=ROOT,
            env={**env, "PORTAL_BIND": f"127.0.0.1:{port}", "PORTAL_WEB_WORKERS": "2"},
            stdout=stdout,
            stderr=stderr,
        )
    try:
        _wait_until_serving(server, port, err)
        status, _, body = _get(port, "/accounts/login/")
        assert status == 200, err.read_text()
        stylesheet = re.search(rb'<link rel="stylesheet" href="([^"]+)"', body).group(1).decode()
        assert re.fullmatch(r"/static/portal\.[0-9a-f]{12}\.css", stylesheet)
        status, headers, css = _get(port, stylesheet)
        assert status == 200
        assert headers["Content-Type"].startswith("text/css")
        assert css == (static_root / stylesheet.removeprefix("/static/")).read_bytes()
        # The refresh URL's token works like a password: the access log never shows it.
        token = secrets.token_urlsafe(24)
        _get(port, f"/ssh/feed/{token}/config")
    finally:
        _stop(server)
    assert server.returncode == 0, err.read_text()
    access_log = out.read_text()
    assert '"GET /accounts/login/ HTTP/1.1" 200' in access_log
    assert '"GET /ssh/feed/[redacted]/config HTTP/1.1"' in access_log
    assert token not in access_log + err.read_text()

"""The README's production steps, followed word for word in a fresh copy of the
repository, give a portal that serves its pages, runs its background work and has a
site admin; the systemd units in docs/deploy.md pass ``systemd-analyze verify``."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.e2e import ends_with_this_process, free_port
from tests.requirements import need

ROOT = Path(__file__).resolve().parents[2]

# What the operator exports (README "Production"), pointed at this test's own services.
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "portal.settings.production",
    "SECRET_KEY": "q8Zr!v2#Lm9@xT4$wN7&kP1^bH6*cJ3(eF5)gD0_aS8-uY2+iO4=zR7~tE9",
    "ALLOWED_HOSTS": "portal.example.org",
    "SITE_URL": "https://portal.example.org",
    "EMAIL_URL": "smtp://portal:secret@127.0.0.1:9?starttls=1",
    "PORTAL_SECRETS_KEY": "kZ3xq2Vb9mT4rW7yP1nL6cJ8hF5dS0aG2eQ4uI9oK3M=",
    "PORTAL_REMOTE_ALLOWED_NETWORKS": "10.128.0.0/9,34.0.0.0/8",
    "PORTAL_ADMIN_EMAIL": "ops@lab.example",
    # Beat's first heartbeat within a few seconds, so the test need not wait a minute.
    "PORTAL_HEARTBEAT_SECONDS": "2",
}
# As the TLS proxy in front of gunicorn passes a request on.
PROXY_HEADERS = {"Host": "portal.example.org", "X-Forwarded-Proto": "https"}


def _clean_environ() -> dict[str, str]:
    """This process's environment without anything that would configure the portal."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DJANGO_", "PORTAL_", "STATIC_", "CELERY_", "VIRTUAL_ENV"))
        and k not in {"WEB_CONCURRENCY", "DATABASE_URL", "CACHE_URL", "EMAIL_URL"}
    }


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


def fresh_copy(destination: Path) -> Path:
    """The repository as a fresh clone has it: the tracked files (as they are in the
    work tree) and new files not ignored, nothing git ignores (no var/, no .venv). The
    Python environment bin/setup made for this run is shared, so bin/setup finds it
    installed instead of downloading it again."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if not source.exists():  # deleted in the work tree, not yet committed
            continue
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    (destination / ".venv").symlink_to(ROOT / ".venv")
    assert not (destination / "var").exists()
    return destination


def _sh_blocks(markdown: str, heading: str) -> list[str]:
    section = markdown.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)\n```", section, re.S)


def readme_production_steps() -> tuple[list[list[str]], list[list[str]]]:
    """(the one-time steps, the long-running processes) of the README's Production
    section, split as the shell would."""
    blocks = _sh_blocks((ROOT / "README.md").read_text(), "### Production")
    assert len(blocks) == 2, "Production: one block of steps, one of the three processes"
    steps, processes = (
        [words for line in block.splitlines() if (words := shlex.split(line, comments=True))]
        for block in blocks
    )
    return steps, processes


def _as_behind_the_proxy(session) -> None:
    for cookie in session.cookies:
        cookie.secure = False


def _wait_for(predicate, what: str, seconds: float, logs) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} within {seconds} s.\n" + "\n".join(p.read_text() for p in logs))


@pytest.mark.slow
def test_the_readme_production_steps_work_word_for_word_in_a_fresh_clone(
    tmp_path, production_services
):
    import requests

    clone = fresh_copy(tmp_path / "clone")
    steps, processes = readme_production_steps()
    # Every kind of line is known here: a new kind of step must be taught to this test,
    # not silently skipped.
    assert [w[0] for w in steps] == [
        "bin/setup",
        ".",
        "export",
        "python",
        "python",
        "python",
        "python",
    ]
    assert [w[:3] for w in processes] == [
        ["gunicorn", "-c", "portal/gunicorn.conf.py"],
        ["celery", "-A", "portal"],
        ["celery", "-A", "portal"],
    ]
    static_root = tmp_path / "static"  # the one change: not /srv on the test machine
    env = {**_clean_environ(), **PRODUCTION_ENV, **production_services}
    ran = []
    for words in steps:
        if words[0] == ".":
            assert words[1] == ".venv/bin/activate"
            env["VIRTUAL_ENV"] = str(clone / ".venv")
            env["PATH"] = f"{clone / '.venv/bin'}:{env['PATH']}"
            continue
        if words[0] == "export":
            for pair in words[1:]:
                name, _, value = pair.partition("=")
                env[name] = str(static_root) if name == "STATIC_ROOT" else value
            continue
        program = shutil.which(words[0], path=env["PATH"]) if words[0] == "python" else words[0]
        result = subprocess.run(
            [program, *words[1:]],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"{shlex.join(words)}:\n{result.stdout}{result.stderr}"
        ran.append((words, result.stdout))

    # The first site admin exists, with a generated password kept for the operator only.
    [admin_out] = [out for words, out in ran if words[-1] == "ensure_site_admin"]
    assert "Created site admin ops@lab.example." in admin_out
    stored = clone / "var" / "site-admin-password"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    password = stored.read_text().strip()
    assert f"Site admin login: ops@lab.example / {password}" in admin_out
    assert (static_root / "staticfiles.json").is_file()

    port = free_port()
    env.update(PORTAL_BIND=f"127.0.0.1:{port}", PORTAL_WEB_WORKERS="2")
    running, logs = [], []
    try:
        for n, words in enumerate(processes):
            log = tmp_path / f"process-{n}.log"
            logs.append(log)
            with log.open("w") as out:
                running.append(
                    subprocess.Popen(
                        [shutil.which(words[0], path=env["PATH"]), *words[1:]],
                        cwd=clone,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=ends_with_this_process,
                    )
                )
        base = f"http://127.0.0.1:{port}"
        session = requests.Session()
        session.headers.update(PROXY_HEADERS)

        def healthy() -> bool:
            for process, log in zip(running, logs, strict=True):
                assert process.poll() is None, f"{process.args} exited:\n{log.read_text()}"
            try:
                answer = session.get(f"{base}/healthz?strict=1", timeout=20)
            except (requests.ConnectionError, requests.Timeout):
                return False
            return answer.status_code == 200 and answer.json()["status"] == "ok"

        # Web, worker and beat all up: the heartbeat beat schedules, a worker records.
        _wait_for(healthy, "/healthz did not say ok", 180, logs)
        assert list((clone / "var").glob("celerybeat-schedule*")), "beat keeps its schedule"

        page = session.get(f"{base}/accounts/login/", timeout=10)
        assert page.status_code == 200
        stylesheet = re.search(r'<link rel="stylesheet" href="([^"]+)"', page.text)[1]
        assert re.fullmatch(r"/static/portal\.[0-9a-f]{12}\.css", stylesheet)
        css = session.get(base + stylesheet, timeout=10)
        assert css.status_code == 200 and css.headers["Content-Type"].startswith("text/css")

        # The refresh URL's token works like a password: the access log never shows it.
        feed_token = secrets.token_urlsafe(24)
        session.get(f"{base}/ssh/feed/{feed_token}/config", timeout=10)

        # The site admin signs in with the printed login, and is sent to set up TOTP.
        # The proxy speaks HTTPS to the browser, so the cookies are Secure; this test
        # speaks plain HTTP to gunicorn behind it, and sends them all the same.
        _as_behind_the_proxy(session)
        token = session.cookies["csrftoken"]
        signed_in = session.post(
            f"{base}/accounts/login/",
            data={"login": "ops@lab.example", "password": password, "csrfmiddlewaretoken": token},
            headers={"Referer": "https://portal.example.org/accounts/login/"},
            allow_redirects=False,
            timeout=10,
        )
        assert signed_in.status_code == 302, signed_in.text[:2000]
        assert "sessionid" in session.cookies
        _as_behind_the_proxy(session)
        first = session.get(base + "/", allow_redirects=False, timeout=10)
        assert first.status_code == 302 and "totp" in first.headers["Location"], first.headers
        _stop(running)
        for process, log in zip(running, logs, strict=True):
            assert process.returncode == 0, f"{process.args}:\n{log.read_text()}"
        access_log = logs[0].read_text()
        assert '"GET /accounts/login/ HTTP/1.1" 200' in access_log
        assert '"GET /ssh/feed/[redacted]/config HTTP/1.1"' in access_log
        assert feed_token not in "".join(log.read_text() for log in logs)
    finally:
        _stop(running)


def _stop(running: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group, as systemd stops a service; KILL after a minute."""
    for process in running:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for process in running:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- the systemd units ---------------------------------------------------------------

UNITS = ("tpu-portal-web.service", "tpu-portal-worker.service", "tpu-portal-beat.service")


def deploy_units() -> dict[str, str]:
    """The unit files docs/deploy.md prints, by name."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    names = re.findall(r"`/etc/systemd/system/(tpu-portal-[a-z]+\.service)`", text)
    blocks = re.findall(r"```ini\n(.*?)```", text, re.S)
    assert len(names) == len(blocks), "each unit is named in a line above its block"
    return dict(zip(names, blocks, strict=True))


def verify_units(units: dict[str, str], root: Path) -> str:
    """``systemd-analyze verify`` on ``units`` as installed in ``root``: the system's own
    units beside them, and the programs their ExecStart lines name, as bin/setup puts
    them in /srv/tpu-portal/app. Returns what it printed (nothing when all is well)."""
    analyze = shutil.which("systemd-analyze")
    need(analyze is not None, "systemd-analyze (Debian's systemd) is not installed")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name, text in units.items():
        (etc / name).write_text(text)
        for line in text.splitlines():
            if line.startswith("ExecStart="):
                program = root / line.removeprefix("ExecStart=").split()[0].lstrip("/")
                program.parent.mkdir(parents=True, exist_ok=True)
                program.write_text("#!/bin/sh\n")
                program.chmod(0o755)
    result = subprocess.run(
        [analyze, "verify", f"--root={root}", *(f"/etc/systemd/system/{n}" for n in units)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return (result.stdout + result.stderr).strip() + ("" if result.returncode == 0 else " (failed)")


def test_the_three_units_in_the_deploy_guide_are_printed_whole():
    units = deploy_units()
    assert sorted(units) == sorted(UNITS)
    commands = {
        "tpu-portal-web.service": "gunicorn -c portal/gunicorn.conf.py portal.wsgi",
        "tpu-portal-worker.service": "celery -A portal worker",
        "tpu-portal-beat.service": "celery -A portal beat",
    }
    for name, text in units.items():
        lines = set(text.splitlines())
        assert {"[Unit]", "[Service]", "[Install]", "WantedBy=multi-user.target"} <= lines, name
        assert {"User=tpu-portal", "Group=tpu-portal"} <= lines, name
        assert {
            "NoNewPrivileges=true",
            "ProtectSystem=strict",
            "ProtectHome=true",
            "PrivateTmp=true",
            "ReadWritePaths=/srv/tpu-portal/var",
            "CapabilityBoundingSet=",
        } <= lines, name
        assert "EnvironmentFile=/etc/tpu-portal/env" in lines, name
        assert commands[name] in text, name


def test_systemd_analyze_verify_passes_the_deploy_guides_units(tmp_path):
    assert verify_units(deploy_units(), tmp_path) == ""


def test_systemd_analyze_verify_would_catch_a_mistyped_unit(tmp_path):
    units = deploy_units()
    units["tpu-portal-web.service"] = units["tpu-portal-web.service"].replace(
        "RestartSec=", "RestartSecs="
    )
    assert "Unknown key 'RestartSecs'" in verify_units(units, tmp_path)

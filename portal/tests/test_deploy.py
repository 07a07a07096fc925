"""Production settings: `check --deploy` is clean, missing values fail loudly, and the
README's production steps serve the portal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_check_deploy_warns_when_metrics_are_open_to_every_address(collected_static):
    env = {
        **PRODUCTION_ENV,
        "STATIC_ROOT": collected_static,
        "PORTAL_METRICS_ALLOWED_NETWORKS": "0.0.0.0/0",
    }
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode != 0
    assert "portal.W001" in result.stderr
    with_token = {**env, "PORTAL_METRICS_TOKEN": "k" * 40}
    assert _manage("check", "--deploy", "--fail-level", "WARNING", env=with_token).returncode == 0


def test_a_metrics_network_that_is_not_a_cidr_fails_every_check():
    env = {**PRODUCTION_ENV, "PORTAL_METRICS_ALLOWED_NETWORKS": "10.0.0.0/8,prometheus"}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert "PORTAL_METRICS_ALLOWED_NETWORKS: 'prometheus' is not an address" in result.stderr

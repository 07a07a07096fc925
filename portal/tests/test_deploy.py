"""Production settings: `check --deploy` is clean, and missing values fail loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
}


def _manage(*args, env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PORTAL_"))}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_production_settings():
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_refuses_to_start_without_a_secret_key():
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "SECRET_KEY"}
    result = _manage("check", env=env)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr


def test_production_refuses_plain_http():
    result = _manage("check", env={**PRODUCTION_ENV, "SITE_URL": "http://portal.example.org"})
    assert result.returncode != 0
    assert "https://" in result.stderr


def test_production_reads_the_secret_key_from_a_file(tmp_path):
    key = tmp_path / "secret"
    key.write_text(PRODUCTION_ENV["SECRET_KEY"] + "\n")
    env = {k: v for k, v in PRODUCTION_ENV.items() if k != "SECRET_KEY"}
    result = _manage(
        "check", "--deploy", "--fail-level", "WARNING", env={**env, "SECRET_KEY_FILE": str(key)}
    )
    assert result.returncode == 0, result.stderr

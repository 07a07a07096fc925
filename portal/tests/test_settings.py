import pytest
from django.core.exceptions import ImproperlyConfigured

from portal import env


def test_it_reads_a_postgres_url():
    db = env.database("postgres://milo:p%40ss@db.internal:5433/portal?sslmode=require")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "milo",
        "p@ss",
        "db.internal",
        "5433",
        "portal",
    )
    assert db["OPTIONS"] == {"sslmode": "require"}


def test_it_refuses_a_relative_sqlite_path():
    with pytest.raises(ImproperlyConfigured, match="four slashes"):
        env.database("sqlite:///relative.db".replace("///", "//"))


def test_it_refuses_an_unknown_database_scheme():
    with pytest.raises(ImproperlyConfigured, match="mysql"):
        env.database("mysql://x/y")


def test_a_bad_boolean_fails_loudly(monkeypatch):
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="FLAG must be true or false"):
        env.boolean("FLAG", False)


def test_a_secret_comes_from_its_file(monkeypatch, tmp_path):
    path = tmp_path / "key"
    path.write_text("s3cret\n")
    monkeypatch.setenv("API_KEY_FILE", str(path))
    assert env.secret("API_KEY") == "s3cret"


def test_a_secret_set_twice_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("API_KEY", "a")
    monkeypatch.setenv("API_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(ImproperlyConfigured, match="not both"):
        env.secret("API_KEY")


def test_an_unreadable_secret_file_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="API_KEY_FILE"):
        env.secret("API_KEY")


def test_a_required_variable_that_is_missing_is_named(monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        env.string("DATABASE_URL")


def test_smtp_urls_become_email_settings():
    mail = env.email("smtp://bot:pw@mail.example.org:587?starttls=1")
    assert mail["EMAIL_HOST"] == "mail.example.org"
    assert mail["EMAIL_PORT"] == 587
    assert mail["EMAIL_USE_TLS"] is True
    assert mail["EMAIL_USE_SSL"] is False
    assert env.email("smtps://mail.example.org")["EMAIL_PORT"] == 465


def test_an_integer_below_its_minimum_is_refused(monkeypatch):
    monkeypatch.setenv("CELERY_VISIBILITY_TIMEOUT", "5")
    with pytest.raises(ImproperlyConfigured, match="at least 60"):
        env.integer("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=60)


def test_the_default_uid_range_meets_nothing_else_hands_out():
    from portal.idranges import DEFAULT_MAX, DEFAULT_MIN, clashes

    assert clashes(DEFAULT_MIN, DEFAULT_MAX) == []


@pytest.mark.parametrize(
    ("first", "last", "what"),
    [
        (20000, 59999, "useradd"),  # the range before: Google's guest agent took from it
        (60000, 70000, "systemd"),
        (90000, 120000, "subordinate ids"),
    ],
)
def test_a_uid_range_that_others_hand_out_is_refused_at_start_up(first, last, what):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PORTAL_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="portal.settings.test",
        PORTAL_UID_MIN=str(first),
        PORTAL_UID_MAX=str(last),
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=root, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "PORTAL_UID_MIN..PORTAL_UID_MAX" in result.stderr and what in result.stderr


@pytest.mark.parametrize(
    "ports", ["80", "8431,8431", "8431,x", ",".join(map(str, range(9000, 9009)))]
)
def test_metrics_ports_that_make_no_sense_are_refused_at_start_up(ports):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "PORTAL_"))}
    env.update(DJANGO_SETTINGS_MODULE="portal.settings.test", PORTAL_CHIP_METRICS_PORTS=ports)
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=root, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "PORTAL_CHIP_METRICS_PORTS is empty or up to 8 distinct ports" in result.stderr

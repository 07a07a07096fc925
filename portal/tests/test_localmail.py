"""Mail on a developer's machine: printed on the console, framed and decoded, and kept
as one file a message in var/mail/; the verify page says where it went; Celery's
periodic-task lines stay out of that console."""

from __future__ import annotations

import email
import email.policy
import logging
import logging.config
import re

import pytest
from django.core import mail
from django.urls import reverse

from portal import localmail
from portal.logs import QuietPeriodicTasks, quiet_periodic_tasks

LINK = "http://127.0.0.1:8000/accounts/confirm-email/MQ:1v2w3x:" + "a" * 60 + "/"


@pytest.fixture
def local_mail(settings, tmp_path):
    settings.EMAIL_BACKEND = localmail.BACKEND
    settings.EMAIL_FILE_PATH = str(tmp_path / "mail")
    return tmp_path / "mail"


def test_each_message_is_printed_whole_and_kept_in_a_file_of_its_own(local_mail, capsys):
    for who in ("milo@uni.example", "ada@uni.example"):
        mail.send_mail("[TPU Portal] Confirm your email", f"Open {LINK}\n", None, [who])

    files = sorted(local_mail.iterdir())
    assert [f.suffix for f in files] == [".eml", ".eml"]
    assert "milo@uni.example" in files[0].name and "ada@uni.example" in files[1].name
    saved = email.message_from_bytes(files[0].read_bytes(), policy=email.policy.default)
    assert saved["To"] == "milo@uni.example"
    assert LINK in saved.get_body(preferencelist=("plain",)).get_content()
    printed = capsys.readouterr().out
    # The link whole on one line (no quoted-printable soft breaks), framed, with its file.
    assert printed.count(f"Open {LINK}\n") == 2
    assert "Email to milo@uni.example\nSubject: [TPU Portal] Confirm your email\n" in printed
    assert f"Saved as {files[0]}\n" in printed
    assert re.search(r"^={72}$", printed, re.M)


@pytest.mark.parametrize(
    ("backend", "says"),
    [
        (localmail.BACKEND, "printed on the console that runs the portal (bin/portal) and saved"),
        ("django.core.mail.backends.console.EmailBackend", "printed on the console"),
        ("django.core.mail.backends.filebased.EmailBackend", "saved as a file in"),
        ("django.core.mail.backends.smtp.EmailBackend", ""),
    ],
)
def test_where_mail_goes_is_said_for_every_backend_but_smtp(settings, tmp_path, backend, says):
    settings.EMAIL_BACKEND = backend
    settings.EMAIL_FILE_PATH = str(settings.BASE_DIR / "var" / "mail")
    where = localmail.where_mail_goes()
    assert where.startswith(says) if says else where == ""
    if "saved" in says:
        assert where.endswith(" var/mail/")


def _sign_up(client):
    return client.post(
        reverse("account_signup"),
        {
            "email": "milo@uni.example",
            "password1": "a long passphrase 42",
            "password2": "a long passphrase 42",
        },
        follow=True,
    )


def test_in_local_mode_the_verify_page_says_where_the_email_went(client, db, local_mail):
    body = _sign_up(client).content.decode()
    assert "Verify Your Email Address" in body
    assert 'id="local-mailbox"' in body
    assert "sends no email: the message was printed on the console" in body
    assert "spam" not in body


def test_with_an_smtp_server_the_verify_page_keeps_its_words(client, db, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", 9  # never reached in the test
    body = _sign_up(client).content.decode()
    assert "check your spam folder" in body
    assert 'id="local-mailbox"' not in body


def _record(name: str, message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_routine_lines_of_periodic_tasks_are_left_out_and_the_rest_kept():
    quiet = QuietPeriodicTasks(frozenset({"tpus.tasks.poll_jobs"}))
    dropped = [
        _record("celery.beat", "Scheduler: Sending due task poll-jobs (tpus.tasks.poll_jobs)"),
        _record("celery.worker.strategy", "Task tpus.tasks.poll_jobs[3f2a] received"),
        _record("celery.app.trace", "Task tpus.tasks.poll_jobs[3f2a] succeeded in 0.01s: None"),
    ]
    kept = [
        _record("celery.app.trace", "Task tpus.tasks.poll_jobs[3f2a] raised", logging.ERROR),
        _record("celery.worker.strategy", "Task tpus.tasks.reconcile_vm[9c] received"),
        _record("celery.redirected", "Email to milo@uni.example"),
        _record("tpus.services.hosts", "tpus.tasks.poll_jobs[ is only a name here"),
    ]
    assert [quiet.filter(r) for r in dropped] == [False] * 3
    assert [quiet.filter(r) for r in kept] == [True] * 4


def test_the_filter_is_on_celerys_loggers_once_the_config_is_applied(settings):
    config = quiet_periodic_tasks(settings.LOGGING)
    assert settings.LOGGING.get("loggers", {}).get("celery.beat") is None  # not changed
    logging.config.dictConfig(config)
    try:
        for name in QuietPeriodicTasks.LOGGERS:
            assert any(isinstance(f, QuietPeriodicTasks) for f in logging.getLogger(name).filters)
    finally:
        logging.config.dictConfig(settings.LOGGING)
        for name in QuietPeriodicTasks.LOGGERS:
            logging.getLogger(name).filters.clear()


def _local_settings():
    """portal.settings.local as this environment makes it (base, then local, anew)."""
    import importlib

    import portal.settings.base as base
    import portal.settings.local as local

    importlib.reload(base)
    return importlib.reload(local)


def test_local_settings_print_and_keep_mail_and_quiet_periodic_tasks(monkeypatch):
    monkeypatch.delenv("EMAIL_URL", raising=False)
    monkeypatch.delenv("PORTAL_LOG_PERIODIC_TASKS", raising=False)
    local = _local_settings()
    assert local.EMAIL_BACKEND == localmail.BACKEND
    assert local.EMAIL_FILE_PATH == str(local.VAR_DIR / "mail")
    assert "quiet_periodic_tasks" in local.LOGGING["loggers"]["celery.beat"]["filters"]

    monkeypatch.setenv("EMAIL_URL", "smtp://mail.example:25")
    monkeypatch.setenv("PORTAL_LOG_PERIODIC_TASKS", "true")
    local = _local_settings()
    assert local.EMAIL_BACKEND == "django.core.mail.backends.smtp.EmailBackend"
    assert "celery.beat" not in local.LOGGING["loggers"]


def test_in_local_mode_the_password_reset_page_says_where_the_email_went(
    client, db, local_mail, make_user
):
    make_user("milo@uni.example")
    body = client.post(
        reverse("account_reset_password"), {"email": "milo@uni.example"}, follow=True
    ).content.decode()
    assert "sends no email: the message was printed on the console" in body
    assert "spam" not in body

"""Fixtures for end-to-end tests: a real SMTP sink, a real Celery worker on the
configured broker, and headless Chromium driven by Playwright."""

from __future__ import annotations

import contextlib
import email
import email.policy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.requirements import need

ROOT = Path(__file__).resolve().parent.parent
# Where the journeys keep what a person should look at (screenshots), git-ignored.
ARTIFACTS = Path(os.environ.get("PORTAL_TEST_ARTIFACTS", ROOT / "test-artifacts"))
# A phone's width and a desktop's, for screenshots and layout checks.
WIDTHS = {"phone": 375, "desktop": 1280}
CHROMIUM = os.environ.get("PORTAL_TEST_CHROMIUM", "/usr/bin/chromium")
# Flags for a sandboxed, offline machine: no background traffic, no sandbox as root.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def expect_every_worker_up_to_date(progress, workers: int, timeout: float = 60_000) -> None:
    """Wait until the VM page's "Provisioning on each worker" (``progress``, a Playwright
    locator; it refreshes itself while changes are in flight) says "up to date" on
    every line and its lines cover ``workers`` workers (a line is one worker, or
    "tpu5-w0 – tpu5-w2 (3 workers)")."""
    deadline = time.monotonic() + timeout / 1000
    while True:
        lines = progress.locator("tr[id^='worker-sync-']").all_inner_texts()  # at once
        # A row's cells come tab-separated: the workers, the state, the last success…
        states = [line.split("\t")[1].strip() if "\t" in line else "" for line in lines]
        covered = sum(
            int(found[1]) if (found := re.search(r"\((\d+) workers\)", line)) else 1
            for line in lines
        )
        if lines and covered == workers and all(s == "up to date" for s in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not every one of {workers} workers is up to date: {lines}")
        time.sleep(0.2)


def screenshots(page, folder: Path, name: str) -> None:
    """Save the whole page at a phone's width and a desktop's (``<name>-375.png``,
    ``<name>-1280.png``), leaving the page at the desktop's."""
    folder.mkdir(parents=True, exist_ok=True)
    for width in WIDTHS.values():
        page.set_viewport_size({"width": width, "height": 900})
        page.screenshot(path=folder / f"{name}-{width}.png", full_page=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Mailbox:
    """Messages an SMTP sink received, parsed; waits for mail that has not come yet."""

    def __init__(self):
        self.messages: list[email.message.EmailMessage] = []
        self._arrived = threading.Condition()

    def add(self, raw: bytes) -> None:
        with self._arrived:
            self.messages.append(email.message_from_bytes(raw, policy=email.policy.default))
            self._arrived.notify_all()

    def wait_for(self, to: str, subject_contains: str = "", timeout: float = 45.0):
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for message in self.messages:
                    if to in message["To"] and subject_contains in message["Subject"]:
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(m["To"], m["Subject"]) for m in self.messages]
                    raise AssertionError(f"no mail to {to} about {subject_contains!r}; got {seen}")
                self._arrived.wait(left)

    @staticmethod
    def body(message) -> str:
        return message.get_body(preferencelist=("plain",)).get_content()

    @classmethod
    def link(cls, message, pattern: str = r"https?://\S+") -> str:
        return re.search(pattern, cls.body(message)).group(0)


@pytest.fixture
def smtp_sink():
    """A real SMTP server on 127.0.0.1 (aiosmtpd) and the mailbox it fills."""
    from aiosmtpd.controller import Controller

    mailbox = Mailbox()
    # A reply such as "451 4.3.0 Try again later" makes the sink refuse every
    # recipient, as a server that is down for maintenance (4xx) or refuses for good
    # (5xx) does; None accepts.
    mailbox.refusing = None

    class Handler:
        async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
            if mailbox.refusing:
                return mailbox.refusing
            envelope.rcpt_tos.append(address)
            return "250 OK"

        async def handle_DATA(self, server, session, envelope):
            mailbox.add(envelope.original_content or envelope.content)
            return "250 OK"

    port = free_port()
    controller = Controller(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    mailbox.port = port
    mailbox.url = f"smtp://127.0.0.1:{port}"
    yield mailbox
    controller.stop()


@pytest.fixture
def smtp_settings(settings, smtp_sink):
    """Point this process's mail at the sink."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = smtp_sink.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    return smtp_sink


def _test_database_name() -> str:
    from django.db import connection

    return connection.settings_dict["NAME"]


def ends_with_this_process() -> None:
    """For ``preexec_fn``: the child is killed when the process that started it ends,
    however it ends. A worker or beat started in a session of its own would otherwise
    outlive a test run that was killed, and go on taking the next run's tasks from
    the same queue with its old settings and code."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def purge_queue(queue: str) -> int:
    """Drop what an earlier test or run left for ``queue`` on the broker: its waiting
    messages, and on Redis the ones a killed worker held unacknowledged, which the
    transport would hand out again an hour later to whichever test then runs. Returns
    how many went."""
    import json

    from portal.celery import app

    with app.connection_for_write() as conn:
        dropped = 0
        with contextlib.suppress(conn.channel_errors):
            dropped = conn.default_channel.queue_purge(queue) or 0
        if not conn.transport_cls.startswith("redis"):
            return dropped
        client = conn.default_channel.client
        held = client.hgetall("unacked")
        mine = [tag for tag, payload in held.items() if json.loads(payload)[-1] == queue]
        if mine:
            client.hdel("unacked", *mine)
            client.zrem("unacked_index", *mine)
        return dropped + len(mine)


@pytest.fixture
def celery_worker_process(transactional_db, smtp_settings, settings):
    """A real `celery worker` subprocess on the test's broker and database; tasks this
    process enqueues go through the broker instead of running inline. It starts on an
    empty queue."""
    from portal.celery import app

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings.test",
        "PORTAL_TEST_DATABASE_NAME": _test_database_name(),
        "PORTAL_TEST_BROKER_URL": settings.CELERY_BROKER_URL,
        "PORTAL_TEST_VAR_DIR": str(settings.VAR_DIR),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "PORTAL_TEST_EMAIL_URL": smtp_settings.url,
        # Django's system checks ran when this test session started; a worker per test
        # need not run them again (Celery's Django fixup does unless told not to).
        "CELERY_SKIP_CHECKS": "true",
    }
    purge_queue(settings.CELERY_TASK_DEFAULT_QUEUE)
    log = open(Path(settings.VAR_DIR) / "celery-worker.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "worker",
            "--pool=solo",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-Q",
            settings.CELERY_TASK_DEFAULT_QUEUE,
            "--loglevel=INFO",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=ends_with_this_process,
    )
    # What a beat or another child process needs to share this worker's world.
    proc.env_for_children = {k: env[k] for k in env if k.startswith(("PORTAL_TEST_", "CELERY_"))}
    previous = app.conf.task_always_eager
    app.conf.task_always_eager = False
    try:
        yield proc
    finally:
        app.conf.task_always_eager = previous
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen, grace: float = 1.0) -> None:
    """Ends a worker or beat a test started, and what it started: TERM, then KILL after
    ``grace`` (on the embedded broker a worker's warm shutdown waits for its next poll,
    about 4 s, and nothing of it is needed once its test is over).

    Only while the process is not reaped: until then its number (and its group's) is
    still its own; after, the system may have given it to another process, another
    test's worker or beat, which a signal to it would kill."""
    if proc.returncode is not None:
        return  # reaped already (a test waited for it)
    with contextlib.suppress(ProcessLookupError):  # a test may have killed it
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def celery_beat(celery_worker_process, settings):
    """``celery_beat(**intervals)``: Celery beat beside the worker, with the periodic
    passes' settings given (``PORTAL_JOB_POLL_SECONDS="1"``…); the sweeps a journey
    does not watch run far apart, so they stay out of its way. Stopped at the end."""
    started = []

    def start(**intervals: str) -> subprocess.Popen:
        env = {
            **os.environ,
            **celery_worker_process.env_for_children,
            "PORTAL_RECONCILE_SWEEP_SECONDS": "3600",
            "PORTAL_EXPIRY_CHECK_SECONDS": "3600",
            **intervals,
        }
        log = open(Path(settings.VAR_DIR) / "celery-beat.log", "w")
        # A schedule of its own: one left by an earlier test would carry its last runs.
        schedule = Path(tempfile.mkdtemp(dir=settings.VAR_DIR)) / "beat-schedule"
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "beat", "--loglevel=INFO",
             "-s", str(schedule)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=ends_with_this_process,
        )  # fmt: skip
        started.append((process, log))
        return process

    yield start
    for process, log in started:
        stop(process)
        log.close()


@pytest.fixture(scope="session")
def browser():
    """Headless Debian Chromium, driven by Playwright (no browser download)."""
    need(shutil.which(CHROMIUM) is not None, f"{CHROMIUM} is not installed (apt install chromium)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; Django's ORM calls in
    # the test body are still synchronous and safe.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        chromium = _Relaunched(playwright)
        yield chromium
        chromium.close()


class _Relaunched:
    """The session's Chromium, launched again if it died: a browser that crashed under
    a loaded machine fails the test it crashed in, not every later test of the worker."""

    def __init__(self, playwright):
        self._playwright = playwright
        self._browser = self._launch()

    def _launch(self):
        return self._playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

    def new_context(self, **options):
        from playwright.sync_api import Error

        try:
            return self._browser.new_context(**options)
        except Error:
            if self._browser.is_connected() and self._answers():
                raise
            self._browser = self._launch()
            return self._browser.new_context(**options)

    def _answers(self) -> bool:
        try:
            self._browser.new_context().close()
        except Exception:
            return False
        return True

    def __getattr__(self, name):
        return getattr(self._browser, name)


@pytest.fixture
def page(browser, live_server, tmp_path):
    """A fresh browser context (no cookies) with a page; screenshots on failure go to
    the test's tmp_path."""
    context = browser.new_context(base_url=live_server.url)
    context.set_default_timeout(15_000)
    page = context.new_page()
    yield page
    context.close()

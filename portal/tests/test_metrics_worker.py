"""A task a real Celery worker process runs shows in the web process's ``/metrics``:
the worker writes its measurement to the database, not to its own memory."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from portal.metrics.histograms import TASK_DURATION
from portal.tasks import send_mail
from portal.tests.metrics_support import scrape
from tests.e2e import celery_worker_process, smtp_settings, smtp_sink  # noqa: F401


@pytest.mark.slow
@pytest.mark.quickstart
def test_a_task_run_by_a_worker_process_is_counted_by_the_web_process(
    celery_worker_process,  # noqa: F811
    client,
    settings,
):
    sample = f"{TASK_DURATION}_count"
    task = {"task": "portal.tasks.send_mail", "outcome": "succeeded"}

    def counted() -> float:
        found = scrape(client, settings)
        names = found.labels_of(sample, "task")
        return found.value(sample, **task) if task["task"] in names else 0

    assert counted() == 0
    send_mail.delay()
    send_mail.delay()
    deadline = time.monotonic() + 60
    while counted() < 2:
        log = Path(settings.VAR_DIR) / "celery-worker.log"
        assert time.monotonic() < deadline, f"the worker's log:\n{log.read_text()}"
        time.sleep(0.2)
    assert counted() == 2
    depth = scrape(client, settings).value(
        "portal_celery_queue_depth", queue=settings.CELERY_TASK_DEFAULT_QUEUE
    )
    assert depth == 0

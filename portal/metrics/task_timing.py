"""How long each Celery task runs and how it ends, recorded in the process that ran
it (a prefork child, or the caller of an eager task) through Celery's own signals:
the start on ``task_prerun``, the end and its state on ``task_postrun``. A task
killed with its process (a hard time limit, an out-of-memory kill) has no end to
record; the broker redelivers it and its next run is counted."""

from __future__ import annotations

import time

from celery.signals import task_postrun, task_prerun

from portal.metrics.histograms import TASK_DURATION, observe

# Celery's states as the outcome label says them.
OUTCOMES = {"SUCCESS": "succeeded", "FAILURE": "failed", "RETRY": "retried"}

# task id -> monotonic start. One process runs one task at a time (prefork), but an
# eager task may run inside another, so the id keeps them apart.
_started: dict[str, float] = {}


@task_prerun.connect(dispatch_uid="portal.metrics.task_started")
def task_started(task_id=None, **_) -> None:
    if task_id:
        _started[task_id] = time.monotonic()


@task_postrun.connect(dispatch_uid="portal.metrics.task_ended")
def task_ended(task_id=None, task=None, state=None, **_) -> None:
    started = _started.pop(task_id, None)
    if started is None or task is None:
        return
    outcome = OUTCOMES.get(state or "", (state or "unknown").lower())
    observe(TASK_DURATION, time.monotonic() - started, task=task.name, outcome=outcome)

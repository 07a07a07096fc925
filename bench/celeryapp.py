"""The portal's Celery app with timing probes, for the benchmarks' worker and beat.

``celery -A bench.celeryapp worker`` runs the unchanged tasks; when ``BENCH_EVENTS``
names a file, each task's start and end and, inside a reconcile, the SSH connect, the
script run, the fan-out and the settling of grants (and a job's start, each Cloud TPU
API call, a created VM put in the lab) are appended to it as JSON lines (wall-clock
``time.time()``, so the benchmark can line them up with its own clock; ``emit`` is
for the benchmark's own threads too). The probes wrap functions; they change no
behaviour.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

from celery.signals import task_postrun, task_prerun

from portal.celery import app

__all__ = ["app"]

_EVENTS = os.environ.get("BENCH_EVENTS", "")
_patched = threading.Lock()
_done = False


def emit(kind: str, **data) -> None:
    if not _EVENTS:
        return
    line = json.dumps({"kind": kind, "pid": os.getpid(), **data}) + "\n"
    # One short write with O_APPEND: lines from several processes do not interleave.
    fd = os.open(_EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _timed(module, name: str, kind: str, describe=None) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            extra = describe(*args) if describe else {}
            emit(kind, start=start, end=time.time(), **extra)

    setattr(module, name, wrapper)


def _install_probes() -> None:
    """Wrap the reconcile's phases (once per process, after Django is ready)."""
    global _done
    with _patched:
        if _done:
            return
        from portal import outbox
        from tpus.cloud import client
        from tpus.remote import Held, ssh
        from tpus.services import emails, inventory, job_engine, reconcile, scheduler

        _timed(ssh, "_connect", "connect", lambda worker, *_: {"worker": str(worker)})
        _timed(ssh.Connection, "run", "run", lambda conn, *_: {"worker": str(conn.worker)})
        _timed(reconcile, "run_on_workers", "fanout", lambda workers, *_: {"n": len(workers)})
        _timed(reconcile, "settle_grants", "settle", lambda vm_id, *_: {"vm": vm_id})
        _timed(reconcile, "_run_once", "run_once", lambda vm_id, *_: {"vm": vm_id})
        # Putting a grant in force (its audit and email with it), and the placement of
        # pool jobs (``bench/elastic.py``).
        _timed(reconcile, "_activate", "activate", lambda grant, *_: {"grant": grant.pk})
        _timed(scheduler, "place", "place", lambda lab_id, *_: {"lab": lab_id})
        _timed(emails, "send_grant_email", "grant_email", lambda grant_id, *_: {"grant": grant_id})
        # An email written at its first attempt ("You can now use"): after the commit.
        _timed(outbox, "_render", "email_written", lambda message: {"email": message.kind})
        _timed(job_engine, "_begin", "job_begin", lambda job, *_: {"job": job.pk})
        # A job's start: every worker's pre-flight (until the last answered), then the
        # word to start and the start answers (``bench/jobstart.py``).
        _timed(job_engine._Hosts, "begin", "job_preflight", lambda hosts, *_: {"vm": hosts.vm.pk})
        _timed(Held, "go", "job_go", lambda held, *_: {"n": len(held.first)})
        # Each Cloud TPU API call by its method, and a VM made put in the lab.
        _timed(client.CloudTPU, "_call", "api", lambda _, method, *__, **___: {"method": method})
        _timed(inventory, "register_created", "register", lambda lab, node, **_: {"vm": node.name})
        _done = True


@task_prerun.connect
def _task_started(task_id=None, task=None, args=None, **_):
    _install_probes()
    emit("task_start", t=time.time(), task=task.name, args=list(args or ()), id=task_id)


@task_postrun.connect
def _task_ended(task_id=None, task=None, args=None, **_):
    emit("task_end", t=time.time(), task=task.name, args=list(args or ()), id=task_id)

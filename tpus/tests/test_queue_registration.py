"""Every process knows the tasks from start-up: the first queue call needs no import,
re-runs nothing of Django's set-up (a worker keeps its logging), is safe from many
threads at once, and a broker that cannot take the task never turns a committed change
into an error page; the periodic sweep queues the work again."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.contrib.messages import get_messages
from django.urls import reverse

from accounts.unix import choose_username
from portal import heartbeat
from portal.celery import app
from tests.e2e import celery_worker_process, smtp_settings, smtp_sink  # noqa: F401
from tpus.models import Grant, TpuVm
from tpus.services import maintenance
from tpus.tasks import reconcile_sweep, record_heartbeat
from tpus.tests.jobs_support import make_vm

ROOT = Path(__file__).resolve().parents[2]

TEN_THREADS = """
import logging, os, threading
import django

django.setup()
from celery.signals import before_task_publish
from portal.celery import app
from tpus import queue

app.conf.task_always_eager = False
app.conf.broker_url = "memory://"
root_handlers = list(logging.getLogger().handlers)
published, failed = [], []
before_task_publish.connect(lambda sender=None, **kw: published.append(sender), weak=False)


class Failures(logging.Handler):
    def emit(self, record):
        failed.append(record.getMessage())


logging.getLogger("tpus.queue").addHandler(Failures())
start = threading.Barrier(10)


def press(vm_id):
    start.wait()
    queue.reconcile_vm(vm_id)  # outside a transaction: handed to the broker at once


threads = [threading.Thread(target=press, args=(n,)) for n in range(10)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert failed == [], failed
assert published == ["tpus.tasks.reconcile_vm"] * 10, published
assert logging.getLogger().handlers == root_handlers, "logging was configured again"
print("ten queued")
"""


def test_ten_threads_queue_their_first_task_at_once_in_a_fresh_process(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings.test",
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "PYTHONPATH": str(ROOT),
        # Queuing outside a transaction asks the database whether it autocommits: a
        # database of the process's own, whichever backend this run uses (the broker is
        # the in-memory one either way).
        "PORTAL_TEST_BACKEND": "embedded",
        "PORTAL_TEST_VAR_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", TEN_THREADS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ten queued" in done.stdout


def _wait(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.quickstart
def test_a_worker_keeps_logging_after_its_first_queue_call(
    celery_worker_process,  # noqa: F811
    settings,
    make_lab,
    make_user,
    add_member,
):
    lab = make_lab("Vision", slug="vision")
    milo = make_user("milo@vision.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    vm = TpuVm.objects.create(lab=lab, name="tpu5", zone="us-central1-f", source="manual")
    grant = Grant.objects.create(user=milo, vm=vm, state="pending")
    log = Path(settings.VAR_DIR) / "celery-worker.log"
    # The worker's sweep queues the VM's reconcile: the first queue call in that process.
    reconcile_sweep.delay()
    _wait(
        lambda: Grant.objects.get(pk=grant.pk).state == "active",
        60,
        f"the reconcile; the worker's log:\n{log.read_text() if log.exists() else ''}",
    )
    record_heartbeat.delay()
    _wait(lambda: heartbeat.last_seen() is not None, 60, "the heartbeat")

    def logged() -> bool:
        text = log.read_text()
        return "tpus.tasks.record_heartbeat[" in text and " succeeded in " in text

    _wait(logged, 15, f"the worker to log the heartbeat task; its log:\n{log.read_text()}")
    assert "tpus.tasks.reconcile_vm[" in log.read_text()


@pytest.fixture
def broker_down(monkeypatch):
    """Tasks go to a broker (not run in-process), and the broker refuses every one."""
    from kombu.exceptions import OperationalError

    refused = []

    def refuse(self, args=None, kwargs=None, **options):
        refused.append((self.name, args))
        raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(type(app.tasks["tpus.tasks.reconcile_vm"]), "apply_async", refuse)
    previous = app.conf.task_always_eager
    app.conf.task_always_eager = False
    try:
        yield refused
    finally:
        app.conf.task_always_eager = previous


@pytest.mark.django_db(transaction=True)
def test_a_committed_grant_is_no_error_page_when_its_task_cannot_be_queued_and_the_sweep_queues_it(
    cast, client, broker_down, caplog, django_capture_on_commit_callbacks
):
    choose_username(cast.member, "milo")
    vm = make_vm(cast.lab)
    vm.workers.update(host_keys=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedHostKeyOfTpu5w0"])
    client.force_login(cast.admin)
    with caplog.at_level(logging.ERROR, logger="tpus.queue"):
        response = client.post(
            reverse("grant_create", args=[cast.lab.slug, vm.pk]), {"user": "milo"}
        )
    assert response.status_code == 302
    assert [m.message for m in get_messages(response.wsgi_request)] == ["Adding milo to tpu5…"]
    grant = Grant.objects.get(user=cast.member, vm=vm)
    assert grant.state == "pending"  # the change stands
    assert ("tpus.tasks.reconcile_vm", (vm.pk,)) in broker_down
    assert "the periodic sweep will queue the work again" in caplog.text
    broker_down.clear()
    maintenance.requeue_stuck_work()
    assert ("tpus.tasks.reconcile_vm", (vm.pk,)) in broker_down

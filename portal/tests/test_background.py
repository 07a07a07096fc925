"""Celery is wired in: a real worker and a real beat, on the run's own broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.urls import reverse

from portal import heartbeat
from portal.celery import app

ROOT = Path(__file__).resolve().parents[2]


def test_tasks_are_acknowledged_late_and_requeued_if_a_worker_dies():
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    # A task may never outlive the broker's redelivery window.
    assert app.conf.task_time_limit < app.conf.broker_transport_options["visibility_timeout"]


def test_the_heartbeat_is_scheduled_in_code():
    import portal.tasks  # noqa: F401 (registers its periodic tasks)
    import tpus.tasks  # noqa: F401

    schedule = {name: entry["task"] for name, entry in app.conf.beat_schedule.items()}
    assert schedule == {
        "heartbeat": "tpus.tasks.record_heartbeat",
        "sync-inventory": "tpus.tasks.sync_inventory",
        "reconcile-sweep": "tpus.tasks.reconcile_sweep",
        "release-stalled-claims": "tpus.tasks.release_stalled_claims",
        "expire-grants": "tpus.tasks.expire_grants",
        "poll-jobs": "tpus.tasks.poll_jobs",
        "follow-vm-requests": "tpus.tasks.follow_vm_requests",
        "look-at-idle-chips": "tpus.tasks.look_at_idle_chips",
        "disk-recheck": "tpus.tasks.recheck_disks",
        "send-mail": "portal.tasks.send_mail",
    }


@pytest.mark.slow
@pytest.mark.quickstart
def test_a_real_beat_and_worker_record_the_heartbeat(
    celery_worker_process, settings, client, make_user
):
    env = {**os.environ, **celery_worker_process.env_for_children, "PORTAL_HEARTBEAT_SECONDS": "1"}
    beat = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "portal",
            "beat",
            "--loglevel=INFO",
            "-s",
            str(Path(settings.VAR_DIR) / "beat-schedule-test"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while heartbeat.last_seen() is None and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(timeout=15)
    assert heartbeat.last_seen() is not None, "no heartbeat within 30 s"
    settings.PORTAL_HEARTBEAT_SECONDS = 1
    client.force_login(make_user(is_superuser=True, is_staff=True))
    assert (
        "Celery worker and beat last checked in"
        in client.get(reverse("dashboard")).content.decode()
    )


def test_the_dashboard_warns_a_site_admin_when_nothing_runs(client, make_user):
    client.force_login(make_user(is_superuser=True, is_staff=True))
    assert "No heartbeat yet" in client.get(reverse("dashboard")).content.decode()

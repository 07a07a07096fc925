"""Celery is wired in: a real worker and a real beat, on the run's own broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.cache import cache
from django.urls import reverse

from portal import heartbeat
from portal.celery import app
from tests.e2e import ends_with_this_process

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
        "elastic-pools": "tpus.tasks.elastic_pools",
        "look-at-idle-chips": "tpus.tasks.look_at_idle_chips",
        "idle-holders": "tpus.tasks.follow_idle_holders",
        "disk-recheck": "tpus.tasks.recheck_disks",
        "expire-snapshots": "tpus.tasks.expire_snapshots",
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
        preexec_fn=ends_with_this_process,
    )
    try:
        deadline = time.monotonic() + 30
        while heartbeat.last_seen() is None and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(timeout=15)
    assert heartbeat.last_seen() is not None, "no heartbeat within 30 s"
    # Read with the usual interval: beat has stopped, and on a loaded machine the page
    # can come more than three 1 s intervals after its last beat.
    settings.PORTAL_HEARTBEAT_SECONDS = 60
    client.force_login(make_user(is_superuser=True, is_staff=True))
    assert (
        "Celery worker and beat last checked in"
        in client.get(reverse("dashboard")).content.decode()
    )


def _background_state(client) -> str:
    body = client.get(reverse("dashboard")).content.decode()
    return body.split('id="background-state">')[1].split("</p>")[0]


@pytest.fixture
def site_admin(client, make_user, settings, monkeypatch):
    """A site admin signed in, beat's heartbeat every 60 s, and this web process
    started ten minutes ago."""
    client.force_login(make_user(is_superuser=True, is_staff=True))
    settings.PORTAL_HEARTBEAT_SECONDS = 60
    monkeypatch.setattr(heartbeat, "PROCESS_STARTED", time.time() - 600)
    cache.delete_many([heartbeat.KEY, heartbeat.BEAT_STARTED_KEY])
    return client


def _ago(seconds: float) -> float:
    return time.time() - seconds


def test_the_dashboard_warns_a_site_admin_when_nothing_runs(site_admin):
    state = _background_state(site_admin)
    assert '<span class="badge failed">not running</span> No heartbeat yet.' in state


def test_a_normal_start_is_starting_not_red_until_the_first_heartbeat_is_overdue(
    site_admin, monkeypatch
):
    # The web process and beat started together a few seconds ago.
    monkeypatch.setattr(heartbeat, "PROCESS_STARTED", _ago(5))
    state = _background_state(site_admin)
    assert '<span class="badge">starting</span> No heartbeat yet since the start' in state
    assert "failed" not in state
    # Beat says when it started: 80 s ago is within the 60 s interval plus the grace.
    cache.set(heartbeat.BEAT_STARTED_KEY, _ago(80))
    assert '<span class="badge">starting</span>' in _background_state(site_admin)
    # 100 s ago: overdue.
    cache.set(heartbeat.BEAT_STARTED_KEY, _ago(100))
    assert '<span class="badge failed">not running</span>' in _background_state(site_admin)
    # The first heartbeat came.
    heartbeat.beat()
    assert '<span class="badge ok">running</span>' in _background_state(site_admin)


def test_a_restart_after_a_stop_is_starting_then_red_if_beat_does_not_come_back(site_admin):
    cache.set(heartbeat.KEY, _ago(86_400))  # the stack was down since yesterday
    state = _background_state(site_admin)
    assert '<span class="badge failed">not running</span> No heartbeat since' in state
    cache.set(heartbeat.BEAT_STARTED_KEY, _ago(10))  # beat started again
    assert '<span class="badge">starting</span>' in _background_state(site_admin)
    cache.set(heartbeat.BEAT_STARTED_KEY, _ago(300))  # and never sent one
    assert '<span class="badge failed">not running</span>' in _background_state(site_admin)


def test_beat_records_its_start(settings):
    from celery.signals import beat_init

    cache.delete(heartbeat.BEAT_STARTED_KEY)
    beat_init.send(sender=None)
    started = heartbeat._when(heartbeat.BEAT_STARTED_KEY)
    assert started is not None and abs(started.timestamp() - time.time()) < 5
    cache.delete(heartbeat.BEAT_STARTED_KEY)

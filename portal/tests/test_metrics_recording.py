"""The durations ``/metrics`` shows are recorded where the work happens: every Celery
task when it ends, every reconcile when it ends, every revoke when the last worker
has applied it; and they add up across processes, since they live in the database."""

from __future__ import annotations

import datetime as dt

import pytest
from celery import shared_task
from django.db import DatabaseError
from django.utils import timezone

from portal.metrics import histograms
from portal.metrics.histograms import RECONCILE_DURATION, REVOKE_DURATION, TASK_DURATION
from portal.models import HistogramBucket
from portal.tasks import send_mail
from portal.tests.metrics_support import scrape
from tpus.models import Grant, TpuVm, WorkerSync
from tpus.services import reconcile
from tpus.tests.jobs_support import make_vm

pytestmark = pytest.mark.django_db


@shared_task(name="portal.tests.broken_for_metrics")
def broken() -> None:
    raise RuntimeError("this task always fails")


def test_a_task_that_runs_is_counted_with_its_outcome_and_time(client, settings):
    task = {"task": "portal.tasks.send_mail", "outcome": "succeeded"}
    send_mail.delay()
    send_mail.delay()
    first = scrape(client, settings)
    assert first.value(f"{TASK_DURATION}_count", **task) == 2
    assert first.value(f"{TASK_DURATION}_sum", **task) > 0
    assert first.value(f"{TASK_DURATION}_bucket", le="+Inf", **task) == 2

    send_mail.delay()
    broken.apply(throw=False)

    second = scrape(client, settings)
    assert second.value(f"{TASK_DURATION}_count", **task) == 3
    failed = {"task": "portal.tests.broken_for_metrics", "outcome": "failed"}
    assert second.value(f"{TASK_DURATION}_count", **failed) == 1


def test_observations_fall_in_their_buckets_and_add_up(client, settings):
    for seconds in (0.3, 7, 7, 50000, 10**6):
        histograms.observe(REVOKE_DURATION, seconds)
    found = scrape(client, settings)
    bucket = f"{REVOKE_DURATION}_bucket"
    assert found.value(bucket, le="0.5") == 1
    assert found.value(bucket, le="5.0") == 1
    assert found.value(bucket, le="10.0") == 3  # cumulative, as Prometheus reads it
    assert found.value(bucket, le="86400.0") == 4
    assert found.value(bucket, le="+Inf") == 5
    assert found.value(f"{REVOKE_DURATION}_count") == 5
    assert found.value(f"{REVOKE_DURATION}_sum") == pytest.approx(0.3 + 14 + 50000 + 10**6)
    assert HistogramBucket.objects.filter(name=REVOKE_DURATION).count() == 4  # a row a bucket


def test_a_measurement_that_cannot_be_stored_does_not_fail_the_work(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise DatabaseError("the database went away")

    monkeypatch.setattr("django.db.backends.utils.CursorWrapper.execute", refuse)
    histograms.observe(REVOKE_DURATION, 2.0)  # no exception
    assert "could not record portal_revoke_duration_seconds" in caplog.text


def test_each_reconcile_is_timed_with_its_outcome(client, settings, make_lab, monkeypatch):
    lab = make_lab()
    empty = TpuVm.objects.create(lab=lab, name="empty", zone="us-central1-f", source="manual")
    # Its worker's address is outside the networks the portal may contact.
    refused = make_vm(lab, "refused")
    reconcile.reconcile_vm(empty.pk)
    reconcile.reconcile_vm(refused.pk)

    def broken(vm_id, report, token):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(reconcile, "_run_once", broken)
    with pytest.raises(DatabaseError):
        reconcile.reconcile_vm(empty.pk)

    found = scrape(client, settings)
    for outcome in ("complete", "incomplete", "error"):
        assert found.value(f"{RECONCILE_DURATION}_count", outcome=outcome) == 1
    outcomes = found.labels_of(f"{RECONCILE_DURATION}_count", "outcome")
    assert outcomes == {"complete", "incomplete", "error"}


def test_a_revoke_is_timed_from_the_click_to_the_last_worker(client, settings, cast):
    vm = make_vm(cast.lab, workers=2)
    clicked = timezone.now() - dt.timedelta(seconds=7)
    grant = Grant.objects.create(
        user=cast.member, vm=vm, state="revoking", version=3, changed_at=clicked
    )
    first, second = vm.workers.order_by("index")
    WorkerSync.objects.create(worker=first, applied_version=3)
    WorkerSync.objects.create(worker=second, applied_version=2)
    reconcile.settle_grants(vm.pk)  # one worker still has the person
    assert scrape(client, settings).value(f"{REVOKE_DURATION}_count") == 0

    WorkerSync.objects.filter(worker=second).update(applied_version=3)
    reconcile.settle_grants(vm.pk)
    reconcile.settle_grants(vm.pk)  # settled once, counted once

    grant.refresh_from_db()
    assert grant.state == "revoked"
    found = scrape(client, settings)
    assert found.value(f"{REVOKE_DURATION}_count") == 1
    assert 7 <= found.value(f"{REVOKE_DURATION}_sum") < 30
    assert found.value(f"{REVOKE_DURATION}_bucket", le="5.0") == 0

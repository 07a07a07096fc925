"""``/metrics``: what the operator's Prometheus reads, who may read it, and that a
scrape costs the same few queries however much the portal holds."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from kombu import Connection

from portal.checks import metrics_not_public
from portal.metrics.figures import queue_names
from portal.models import OutboxMessage
from portal.tests.metrics_support import TOKEN, Scrape, scrape
from tpus.models import Grant, ZoneSync
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db

EVERY_FAMILY = {
    "portal_broker_up",
    "portal_celery_queue_depth",
    "portal_outbox_messages",
    "portal_outbox_oldest_waiting_seconds",
    "portal_lab_sync_age_seconds",
    "portal_lab_sync_failing_zones",
    "portal_queued_jobs",
    "portal_queued_job_oldest_wait_seconds",
    "portal_jobs",
    "portal_grants",
    "portal_task_duration_seconds",
    "portal_reconcile_duration_seconds",
    "portal_revoke_duration_seconds",
}


def _outbox(state: str, *, age: float = 0, to: str = "milo@vision.example") -> OutboxMessage:
    now = timezone.now()
    return OutboxMessage.objects.create(
        kind="grant_active",
        to=to,
        subject="You can now use tpu5",
        message_id=f"<{state}-{age}-{to}>",
        state=state,
        next_attempt_at=now,
        created_at=now - dt.timedelta(seconds=age),
    )


def test_with_nothing_configured_the_page_does_not_exist(client, settings):
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = []
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 404


def test_a_scrape_without_the_right_token_is_refused(client, settings):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    for header in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"}, {"HTTP_AUTHORIZATION": TOKEN}):
        response = client.get("/metrics", **header)
        assert response.status_code == 401
        assert response["WWW-Authenticate"] == 'Bearer realm="metrics"'
        assert b"portal_" not in response.content
    # Never in the address, where access logs would keep it.
    assert client.get(f"/metrics?token={TOKEN}").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200


def test_an_allowed_network_lets_its_addresses_in_and_no_other(client, settings):
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = ["10.20.0.0/16"]
    assert client.get("/metrics", REMOTE_ADDR="10.20.3.4").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.21.3.4").status_code == 403
    # Anyone can write X-Forwarded-For: it counts only from a trusted proxy.
    forged = client.get("/metrics", REMOTE_ADDR="198.51.100.7", HTTP_X_FORWARDED_FOR="10.20.3.4")
    assert forged.status_code == 403
    settings.PORTAL_TRUSTED_PROXIES = ["127.0.0.1"]
    proxied = {"REMOTE_ADDR": "127.0.0.1"}
    assert client.get("/metrics", HTTP_X_FORWARDED_FOR="10.20.3.4", **proxied).status_code == 200
    assert client.get("/metrics", HTTP_X_FORWARDED_FOR="10.21.3.4", **proxied).status_code == 403


def test_with_a_token_and_a_network_both_must_pass(client, settings):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = ["10.20.0.0/16"]
    right = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    assert client.get("/metrics", REMOTE_ADDR="10.20.3.4", **right).status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.99.3.4", **right).status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="10.20.3.4").status_code == 401


def test_every_family_is_exported_and_parses(client, settings):
    found = scrape(client, settings)
    assert EVERY_FAMILY <= set(found.families)
    assert found.families["portal_task_duration_seconds"].type == "histogram"
    assert found.value("portal_broker_up") == 1


def test_jobs_grants_and_the_waits_of_queued_jobs_are_counted(
    client, settings, cast, make_user, add_member
):
    vm = make_vm(cast.lab)
    other_vm = make_vm(cast.other_lab, "tpu9")
    ann = make_user("ann@vision.example")
    add_member(cast.lab, ann)
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    Grant.objects.create(user=ann, vm=vm, state="revoking")
    Grant.objects.create(user=cast.outsider, vm=other_vm, state="active")
    now = timezone.now()
    make_job(vm, cast.member, "running")
    make_job(vm, cast.member, "queued", queued_at=now - dt.timedelta(minutes=10))
    make_job(vm, ann, "blocked", queued_at=now - dt.timedelta(minutes=3))
    make_job(vm, ann, "succeeded")
    make_job(vm, ann, "succeeded")

    found = scrape(client, settings)

    assert found.value("portal_jobs", state="running") == 1
    assert found.value("portal_jobs", state="queued") == 1
    assert found.value("portal_jobs", state="blocked") == 1
    assert found.value("portal_jobs", state="succeeded") == 2
    assert found.value("portal_jobs", state="lost") == 0
    assert found.value("portal_grants", state="active") == 2
    assert found.value("portal_grants", state="revoking") == 1
    assert found.value("portal_grants", state="failed") == 0
    assert found.value("portal_queued_jobs", lab="vision") == 2
    assert found.value("portal_queued_jobs", lab="other") == 0
    assert 600 <= found.value("portal_queued_job_oldest_wait_seconds", lab="vision") < 660
    assert found.value("portal_queued_job_oldest_wait_seconds", lab="other") == 0


def test_the_outbox_says_what_waits_and_what_failed_and_names_nobody(client, settings):
    _outbox("pending", age=120)
    _outbox("pending", age=30, to="ann@vision.example")
    _outbox("failed", age=9000)
    _outbox("sent", age=5)

    found = scrape(client, settings)

    assert found.value("portal_outbox_messages", state="waiting") == 2
    assert found.value("portal_outbox_messages", state="failed") == 1
    assert 120 <= found.value("portal_outbox_oldest_waiting_seconds") < 180
    assert "@" not in found.text


def test_each_labs_sync_age_is_its_least_recently_listed_zone(client, settings, make_lab):
    now = timezone.now()
    fresh = make_lab(slug="fresh", zones=["us-central1-f", "us-east1-d"])
    ZoneSync.objects.create(lab=fresh, zone="us-central1-f", last_success_at=now)
    ZoneSync.objects.create(
        lab=fresh,
        zone="us-east1-d",
        last_success_at=now - dt.timedelta(seconds=400),
        last_failure_at=now,
        failing_since=now - dt.timedelta(seconds=300),
    )
    half = make_lab(slug="half-listed", zones=["us-central1-f", "europe-west4-a"])
    ZoneSync.objects.create(lab=half, zone="us-central1-f", last_success_at=now)
    make_lab(slug="no-zones", zones=[])

    found = scrape(client, settings)

    assert 400 <= found.value("portal_lab_sync_age_seconds", lab="fresh") < 460
    assert found.value("portal_lab_sync_failing_zones", lab="fresh") == 1
    assert found.value("portal_lab_sync_age_seconds", lab="half-listed") == float("inf")
    assert found.value("portal_lab_sync_failing_zones", lab="half-listed") == 0
    assert "no-zones" not in found.labels_of("portal_lab_sync_age_seconds", "lab")
    assert found.value("portal_queued_jobs", lab="no-zones") == 0


def test_the_queue_depth_is_what_waits_in_the_broker(client, settings):
    name = queue_names()[0]
    assert name == django_settings.CELERY_TASK_DEFAULT_QUEUE
    before = scrape(client, settings).value("portal_celery_queue_depth", queue=name)
    with Connection(django_settings.CELERY_BROKER_URL) as conn:
        queue = conn.SimpleQueue(name)
        try:
            for n in range(3):
                queue.put({"n": n})
            after = scrape(client, settings).value("portal_celery_queue_depth", queue=name)
        finally:
            queue.clear()
            queue.close()
    assert after == before + 3


def test_a_broker_that_does_not_answer_is_said_and_the_rest_still_shown(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"
    found = scrape(client, settings)
    assert found.value("portal_broker_up") == 0
    assert not found.labels_of("portal_celery_queue_depth", "queue")
    assert found.value("portal_grants", state="active") == 0


def _fill(cast, make_lab, make_user, add_member, n: int) -> None:
    for i in range(n):
        lab = make_lab(slug=f"busy-{n}-{i}", zones=["us-central1-f", "us-east1-d"])
        ZoneSync.objects.create(lab=lab, zone="us-central1-f", last_success_at=timezone.now())
        vm = make_vm(lab, f"tpu-{n}-{i}")
        person = make_user()
        add_member(lab, person)
        Grant.objects.create(user=person, vm=vm, state="active")
        for state in ("running", "queued", "queued", "succeeded"):
            make_job(vm, person, state)
        _outbox("pending", age=i, to=f"p{n}{i}@example.org")


def test_a_scrape_costs_the_same_queries_however_much_there_is(
    client, settings, cast, make_lab, make_user, add_member
):
    settings.PORTAL_METRICS_TOKEN = TOKEN
    auth = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    _fill(cast, make_lab, make_user, add_member, 1)
    with CaptureQueriesContext(connection) as small:
        assert client.get("/metrics", **auth).status_code == 200
    _fill(cast, make_lab, make_user, add_member, 6)
    with CaptureQueriesContext(connection) as large:
        response = client.get("/metrics", **auth)
    assert len(small) == len(large) == 7, [q["sql"] for q in large.captured_queries]
    assert Scrape(response.content.decode()).value("portal_queued_jobs", lab="busy-6-5") == 2


def test_check_deploy_warns_when_anyone_could_read_the_metrics(settings):
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = ["10.0.0.0/8", "::/0"]
    assert [w.id for w in metrics_not_public(None)] == ["portal.W001"]
    settings.PORTAL_METRICS_TOKEN = "short"
    assert [w.id for w in metrics_not_public(None)] == ["portal.W002"]
    settings.PORTAL_METRICS_TOKEN = TOKEN
    assert metrics_not_public(None) == []
    settings.PORTAL_METRICS_TOKEN = ""
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = ["10.0.0.0/8"]
    assert metrics_not_public(None) == []
    settings.PORTAL_METRICS_ALLOWED_NETWORKS = []
    assert metrics_not_public(None) == []  # off

"""A Cloud TPU API outage is visible: each lab's pages and API say since when listing a
zone fails and why, and the lab's admins get one email once it has lasted too long
and one when it works again, however many syncs run."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import mail
from django.urls import reverse

from accounts.services import create_token
from tpus.models import AuditEvent, ZoneSync
from tpus.services import inventory, sync

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


@pytest.fixture
def lab(tpu_emulator, cast, settings):
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    settings.PORTAL_SYNC_ALERT_SECONDS = 600
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu5", workers=1, external_ips=["34.0.0.1"])
    inventory.import_vms(cast.admin, lab, [f"{ZONE}/tpu5"])
    mail.outbox.clear()
    return lab


def _sync(capture):
    with capture(execute=True):
        return sync.sync_inventory()


def _outage_began(seconds_ago: int) -> None:
    """As if the current outage had started ``seconds_ago``."""
    for row in ZoneSync.objects.exclude(failing_since=None):
        row.failing_since -= dt.timedelta(seconds=seconds_ago)
        row.save()


def _api_vms(client, cast):
    token = create_token(cast.admin, "t")[1]
    return client.get(
        f"/api/v1/labs/{cast.lab.slug}/vms", HTTP_AUTHORIZATION=f"Bearer {token}"
    ).json()["items"]


def _sync_mail(word: str) -> list:
    """The lab's admin's sync emails (the other lab of the cast has its own)."""
    return [m for m in mail.outbox if word in m.subject and m.to == ["admin@vision.example"]]


def test_a_listing_that_works_is_recorded_as_the_last_success(lab, cast, client):
    sync.sync_inventory()
    row = ZoneSync.objects.get(lab=lab, zone=ZONE)
    assert row.last_success_at and not row.failing and row.last_error == ""
    [vm] = _api_vms(client, cast)
    assert vm["sync"]["failing"] is False and vm["sync"]["last_success_at"]


def test_an_outage_shows_its_error_and_since_when_on_the_pages_and_in_the_api(
    lab, cast, client, tpu_emulator, django_capture_on_commit_callbacks
):
    tpu_emulator.controls.fail(100, "UNAVAILABLE", method="ListNodes")
    report = _sync(django_capture_on_commit_callbacks)
    assert report.errors
    row = ZoneSync.objects.get(lab=lab, zone=ZONE)
    assert row.failing_since and "UNAVAILABLE" in row.last_error
    # The CloudError's message, hint included.
    assert "the Cloud TPU API is unreachable right now" in row.last_error
    [vm] = _api_vms(client, cast)
    assert vm["sync"]["failing"] is True
    assert vm["sync"]["failing_since"] and "UNAVAILABLE" in vm["sync"]["last_error"]
    client.force_login(cast.admin)
    for page in ("vm_list", "lab_admin"):
        html = client.get(reverse(page, args=[lab.slug])).content.decode()
        assert "failing since" in html and "unreachable right now" in html, page
    token = create_token(cast.admin, "t")[1]
    [api_lab] = [
        entry
        for entry in client.get("/api/v1/labs", HTTP_AUTHORIZATION=f"Bearer {token}").json()[
            "items"
        ]
        if entry["slug"] == lab.slug
    ]
    assert api_lab["sync"][0]["zone"] == ZONE and api_lab["sync"][0]["failing"] is True
    # A short outage is no news yet.
    assert not _sync_mail("cannot be listed")


def test_members_do_not_see_the_sync_status_of_the_lab(lab, cast, client, tpu_emulator):
    tpu_emulator.controls.fail(100, "UNAVAILABLE", method="ListNodes")
    sync.sync_inventory([lab])
    token = create_token(cast.member, "t")[1]
    body = client.get(f"/api/v1/labs/{lab.slug}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert body["sync"] is None


def test_an_outage_longer_than_the_threshold_emails_the_admins_once_and_its_end_once(
    lab, cast, client, tpu_emulator, django_capture_on_commit_callbacks
):
    tpu_emulator.controls.fail(1000, "UNAVAILABLE", method="ListNodes")
    _sync(django_capture_on_commit_callbacks)
    _outage_began(601)
    _sync(django_capture_on_commit_callbacks)
    [alert] = _sync_mail("cannot be listed")
    assert ZONE in alert.subject and "UNAVAILABLE" in alert.body
    # Every later failed sync: still one email.
    _sync(django_capture_on_commit_callbacks)
    _sync(django_capture_on_commit_callbacks)
    assert len(_sync_mail("cannot be listed")) == 1
    assert AuditEvent.objects.filter(lab=lab, action="lab.sync_failing").count() == 1

    tpu_emulator.controls.clear_faults()
    _sync(django_capture_on_commit_callbacks)
    _sync(django_capture_on_commit_callbacks)
    [recovered] = _sync_mail("again")
    assert ZONE in recovered.subject
    assert AuditEvent.objects.filter(lab=lab, action="lab.sync_recovered").count() == 1
    row = ZoneSync.objects.get(lab=lab)
    assert not row.failing and row.last_error == "" and row.alerted_at is None
    client.force_login(cast.admin)
    html = client.get(reverse("vm_list", args=[lab.slug])).content.decode()
    assert "failing since" not in html and "unreachable" not in html


def test_an_api_that_stops_answering_is_an_outage_too(
    lab, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_SYNC_ALERT_SECONDS = 0
    tpu_emulator.stop()
    _sync(django_capture_on_commit_callbacks)
    row = ZoneSync.objects.get(lab=lab)
    assert row.failing and "ListNodes failed" in row.last_error
    assert len(_sync_mail("cannot be listed")) == 1


def test_a_short_outage_that_ends_sends_nothing(
    lab, tpu_emulator, django_capture_on_commit_callbacks
):
    tpu_emulator.controls.fail(100, "UNAVAILABLE", method="ListNodes")
    _sync(django_capture_on_commit_callbacks)
    tpu_emulator.controls.clear_faults()
    _sync(django_capture_on_commit_callbacks)
    assert not _sync_mail("listed")
    row = ZoneSync.objects.get(lab=lab)
    assert not row.failing and row.last_failure_at and row.last_success_at


@pytest.mark.django_db(transaction=True)
def test_two_syncs_at_once_send_one_alert_and_one_recovery(
    tpu_emulator, make_lab, make_user, add_member, settings
):
    import threading

    from django.db import connection

    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    settings.PORTAL_SYNC_ALERT_SECONDS = 0
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    add_member(lab, make_user("boss@vision.example"), role="admin")

    def twice():
        barrier = threading.Barrier(2)

        def run():
            barrier.wait()
            try:
                sync.sync_inventory([lab])
            finally:
                connection.close()

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    tpu_emulator.controls.fail(1000, "UNAVAILABLE", method="ListNodes")
    twice()
    assert len([m for m in mail.outbox if "cannot be listed" in m.subject]) == 1
    tpu_emulator.controls.clear_faults()
    twice()
    assert len([m for m in mail.outbox if "again" in m.subject]) == 1

"""The beat's sync fans out: its tick queues one task per lab, and each lists only its
own lab's zones, one task per lab at a time. A lab whose zone hangs or fails (a slow
region, a broken project) delays no other lab's listing, nor its IP-change emails."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.core import mail
from django.db import connection
from django.utils import timezone

from accounts.unix import choose_username
from tpus import tasks
from tpus.models import Grant, IpChange, Lab, ZoneSync
from tpus.services import inventory, sync

SLOW, HEALTHY, ZONE = "slow-region-lab", "vision-lab-1", "us-central1-f"
SYNC_LAB = "tpus.tasks.sync_lab_inventory"


def _timed(call) -> float:
    began = time.monotonic()
    call()
    return time.monotonic() - began


@pytest.fixture
def labs(tpu_emulator, make_lab, make_user, add_member, settings):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    made = {}
    scene = [(SLOW, "slow", "tpu3", "34.0.0.3"), (HEALTHY, "vision", "tpu5", "34.0.0.5")]
    for project, slug, node, ip in scene:
        lab = make_lab(slug.title(), slug=slug, gcp_project_id=project, zones=[ZONE])
        admin = make_user(f"boss@{slug}.example")
        add_member(lab, admin, role="admin")
        tpu_emulator.controls.add_node(project, ZONE, node, workers=1, external_ips=[ip])
        [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/{node}"])
        made[slug] = (lab, vm)
    milo = make_user("milo@uni.example")
    add_member(made["vision"][0], milo)
    choose_username(milo, "milo")
    Grant.objects.create(user=milo, vm=made["vision"][1], state="active")
    mail.outbox.clear()
    return made["slow"][0], made["vision"][0]


def test_the_beats_tick_queues_one_sync_per_lab_and_asks_google_nothing(
    labs, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    slow, healthy = labs
    tpu_emulator.controls.slow(SLOW, 3)
    before = tpu_emulator.requests["ListNodes"]

    with django_capture_on_commit_callbacks(execute=True):
        took = _timed(tasks.sync_inventory)

    assert took < 0.5, took
    assert tpu_emulator.requests["ListNodes"] == before
    queued = sorted(args for args, _ in queued_tasks.take(SYNC_LAB))
    assert queued == sorted([(slow.pk,), (healthy.pk,)])


def test_a_lab_whose_zone_hangs_delays_no_other_labs_sync_nor_its_ip_email(
    labs, tpu_emulator, queued_tasks, settings, django_capture_on_commit_callbacks
):
    slow, healthy = labs
    settings.TPU_API_TIMEOUT = 1
    tpu_emulator.controls.slow(SLOW, 2)  # past the timeout: every try of the listing fails
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    with django_capture_on_commit_callbacks(execute=True):
        tasks.sync_inventory()
    due = {args[0]: args for args, _ in queued_tasks.take(SYNC_LAB)}

    # The healthy lab's share of the tick: its change and its email, at once.
    with django_capture_on_commit_callbacks(execute=True):
        took = _timed(lambda: tasks.sync_lab_inventory(*due[healthy.pk]))
    assert took < 2.0, took  # (a loaded machine's margin; the slow lab's share takes 3 s)
    change = IpChange.objects.get()
    assert (change.worker.vm.lab_id, change.new_ip) == (healthy.pk, "35.9.9.9")
    assert [m.to for m in mail.outbox if "35.9.9.9" in m.subject] == [["milo@uni.example"]]

    # The slow lab's share takes its tries' time, and records the failure on it only.
    with django_capture_on_commit_callbacks(execute=True):
        took = _timed(lambda: tasks.sync_lab_inventory(*due[slow.pk]))
    assert took >= 3.0, took
    assert ZoneSync.objects.get(lab=slow, zone=ZONE).failing
    assert not ZoneSync.objects.get(lab=healthy, zone=ZONE).failing
    assert not Lab.objects.filter(sync_claimed_until__isnull=False).exists()


def test_one_sync_of_a_lab_at_a_time(labs, tpu_emulator):
    _, healthy = labs
    before = tpu_emulator.requests["ListNodes"]
    held = timezone.now() + dt.timedelta(seconds=60)
    Lab.objects.filter(pk=healthy.pk).update(sync_claimed_until=held)  # a task lists it now
    assert sync.sync_lab(healthy.pk) is None
    assert tpu_emulator.requests["ListNodes"] == before

    # Its holder died: the lease runs out and the next sync lists the lab.
    Lab.objects.filter(pk=healthy.pk).update(sync_claimed_until=timezone.now())
    report = sync.sync_lab(healthy.pk)
    assert report is not None and report.listed == 1
    assert tpu_emulator.requests["ListNodes"] == before + 1
    assert Lab.objects.get(pk=healthy.pk).sync_claimed_until is None


@pytest.mark.django_db(transaction=True)
def test_two_syncs_of_a_lab_at_once_list_it_once(tpu_emulator, make_lab, make_user):
    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    lab = make_lab("Vision", slug="vision", gcp_project_id=HEALTHY, zones=[ZONE])
    tpu_emulator.controls.add_node(HEALTHY, ZONE, "tpu5", workers=1, external_ips=["34.0.0.5"])
    inventory.import_vms(make_user("boss@vision.example"), lab, [f"{ZONE}/tpu5"])
    tpu_emulator.controls.slow(HEALTHY, 1)  # long enough for both to be under way
    before = tpu_emulator.requests["ListNodes"]
    barrier = threading.Barrier(2)
    reports = []

    def run():
        barrier.wait()
        try:
            reports.append(sync.sync_lab(lab.pk))
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r is None for r in reports) == [False, True]
    assert tpu_emulator.requests["ListNodes"] == before + 1

"""A worker's address changes while the SMTP server refuses mail for five minutes:
once it takes mail again, each person gets exactly one email about it.

The scene is real apart from the clock: the Cloud TPU API emulator, the portal's own
sync, a real SMTP server (aiosmtpd) that answers "451 try again later" during the
outage, and the outbox sweep the beat schedules every PORTAL_MAIL_SWEEP_SECONDS. The
five minutes are not slept: each sweep tick moves every stored outbox time back by
one sweep interval, which is what the passing of that time looks like to the outbox."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings
from django.core import mail
from django.db.models import F

from accounts.unix import choose_username
from portal.models import OutboxMessage, OutboxState
from portal.tasks import send_mail as sweep
from tpus.models import Grant, IpChange, IpChangeNotice
from tpus.services import inventory, sync
from tpus.tasks import reconcile_sweep

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
OUTAGE_SECONDS = 300


def _tick() -> None:
    """One beat interval passes, then the scheduled sweep runs."""
    step = dt.timedelta(seconds=settings.PORTAL_MAIL_SWEEP_SECONDS)
    OutboxMessage.objects.update(
        created_at=F("created_at") - step, next_attempt_at=F("next_attempt_at") - step
    )
    sweep()


@pytest.mark.django_db(transaction=True)
def test_mail_about_an_ip_change_survives_a_five_minute_smtp_outage_exactly_once(
    tpu_emulator, make_lab, make_user, add_member, smtp_settings
):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu5", workers=1, external_ips=["34.0.0.1"])
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    people = [f"{name}@uni.example" for name in ("milo", "ada", "kai")]
    for address in people:
        user = make_user(address)
        add_member(lab, user)
        choose_username(user, address.split("@")[0])
        Grant.objects.create(user=user, vm=vm, state="active")

    smtp_settings.refusing = "451 4.3.0 Mail server temporarily unavailable"
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    sync.sync_inventory()
    assert IpChangeNotice.objects.filter(sent_at__isnull=False).count() == 3
    for _ in range(OUTAGE_SECONDS // settings.PORTAL_MAIL_SWEEP_SECONDS):
        _tick()
    waiting = list(OutboxMessage.objects.filter(kind="ip_changed"))
    assert len(waiting) == 3
    assert all(m.state == OutboxState.PENDING and "451" in m.last_error for m in waiting)
    attempts = sorted(m.attempts for m in waiting)
    print(f"during a {OUTAGE_SECONDS} s outage each message was tried {attempts} times")
    assert min(attempts) >= 3  # retried all along, not given up on
    assert not smtp_settings.messages

    smtp_settings.refusing = None
    ticks = 0
    while OutboxMessage.objects.filter(state=OutboxState.PENDING).exists():
        ticks += 1
        assert ticks <= 2 * settings.PORTAL_MAIL_RETRY_MAX_SECONDS // 30, "never delivered"
        _tick()
    print(f"all delivered {ticks * settings.PORTAL_MAIL_SWEEP_SECONDS} s after SMTP came back")
    about_it = sorted(m["To"] for m in smtp_settings.messages if "35.9.9.9" in m["Subject"])
    assert about_it == sorted(people)

    for _ in range(10):  # the sweep keeps running; nothing goes out again
        _tick()
    assert len(smtp_settings.messages) == 3
    assert set(OutboxMessage.objects.values_list("state", flat=True)) == {OutboxState.SENT}


def test_a_notice_an_earlier_version_left_unwritten_is_mailed_once_by_the_sweep(
    db, tpu_emulator, make_lab, make_user, add_member, django_capture_on_commit_callbacks
):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu5", workers=1, external_ips=["34.0.0.1"])
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    Grant.objects.create(user=milo, vm=vm, state="active")
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    sync.sync_inventory()
    # As an earlier version left it: the notice recorded, its email task lost.
    OutboxMessage.objects.all().delete()
    IpChangeNotice.objects.update(sent_at=None)
    with django_capture_on_commit_callbacks(execute=True):
        reconcile_sweep()
    assert not OutboxMessage.objects.exists()  # a fresh notice may still be on its way
    IpChange.objects.update(seen_at=F("seen_at") - dt.timedelta(minutes=6))
    for _ in range(2):
        with django_capture_on_commit_callbacks(execute=True):
            reconcile_sweep()
    [message] = mail.outbox
    assert message.to == ["milo@uni.example"] and "35.9.9.9" in message.subject

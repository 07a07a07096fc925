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
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from accounts.unix import choose_username
from portal import mail as portal_mail
from portal import outbox
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
    # The first sweep after the server returns sends everything (no back-off outlives it).
    assert ticks == 1
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


def _written(count: int, first: int = 0) -> list[int]:
    """``count`` messages to admin<first>… (each in its own committed transaction, as a
    grant turning active writes its email), each first tried at once."""
    for n in range(first, first + count):
        with transaction.atomic():
            portal_mail.send(
                "drift_found",
                [f"admin{n}@vision.example"],
                {
                    "worker": {"alias": "tpu5-w0"},
                    "vm": {"name": "tpu5", "pk": 5},
                    "lab": {"name": "Vision", "slug": "vision"},
                    "usernames": ["mallory"],
                },
            )
    return list(OutboxMessage.objects.order_by("-pk").values_list("pk", flat=True)[:count])


def _long_outage(pks: list[int], minutes: int = 30) -> None:
    """As after an hour of outage: many attempts made, the next one half an hour out."""
    OutboxMessage.objects.filter(pk__in=pks).update(
        attempts=9, next_attempt_at=timezone.now() + dt.timedelta(minutes=minutes)
    )


@pytest.mark.django_db(transaction=True)
def test_once_one_message_goes_through_every_waiting_message_goes_out_at_the_next_sweep_once(
    smtp_settings,
):
    smtp_settings.refusing = "451 4.3.0 Mail server temporarily unavailable"
    waiting = _written(5)
    assert all(
        m.backing_off and "451" in m.last_error
        for m in OutboxMessage.objects.filter(pk__in=waiting)
    )
    _long_outage(waiting)
    smtp_settings.refusing = None
    [fresh] = _written(1, first=5)  # the server is back: a new message goes through at once
    assert OutboxMessage.objects.get(pk=fresh).state == OutboxState.SENT
    assert len(smtp_settings.messages) == 1
    sweep()  # beat runs it every PORTAL_MAIL_SWEEP_SECONDS (30 s by default)
    assert sorted(m["To"] for m in smtp_settings.messages) == sorted(
        f"admin{n}@vision.example" for n in range(6)
    )
    for _ in range(3):
        sweep()
    assert len(smtp_settings.messages) == 6
    assert set(OutboxMessage.objects.values_list("state", flat=True)) == {OutboxState.SENT}


@pytest.mark.django_db(transaction=True)
def test_with_no_new_mail_the_next_sweep_finds_the_server_back_and_sends_everything_once(
    smtp_settings,
):
    smtp_settings.refusing = "451 4.3.0 Mail server temporarily unavailable"
    waiting = _written(4)
    _long_outage(waiting)
    sweep()  # nothing due: one message is tried anyway, and is refused
    assert not smtp_settings.messages
    assert OutboxMessage.objects.filter(state=OutboxState.PENDING).count() == 4
    smtp_settings.refusing = None
    sweep()
    assert sorted(m["To"] for m in smtp_settings.messages) == sorted(
        f"admin{n}@vision.example" for n in range(4)
    )
    sweep()
    assert len(smtp_settings.messages) == 4


@pytest.mark.django_db(transaction=True)
def test_a_message_being_sent_keeps_its_lease_when_another_send_succeeds(smtp_settings):
    smtp_settings.refusing = "451 4.3.0 Mail server temporarily unavailable"
    [pk] = _written(1)
    _long_outage([pk])
    message = outbox.claim_soonest_waiting()  # another sweep has it, mid-attempt
    assert message is not None and not OutboxMessage.objects.get(pk=pk).backing_off
    lease = OutboxMessage.objects.get(pk=pk).next_attempt_at
    smtp_settings.refusing = None
    _written(1, first=1)  # a success elsewhere ends back-offs, not leases
    assert OutboxMessage.objects.get(pk=pk).next_attempt_at == lease
    assert outbox.claim_next_due() is None
    assert outbox.attempt(message)
    assert [m["To"] for m in smtp_settings.messages].count("admin0@vision.example") == 1

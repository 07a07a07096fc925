"""Every email is written to the outbox in the transaction of the change it tells of:
a process that dies right after that commit (before it could try to send, or queue
anything) loses nothing, and the outbox's sweep sends each message exactly once."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core import mail
from django.db import connection
from django.db.models import F

from accounts.unix import choose_username
from portal.models import OutboxMessage, OutboxState
from portal.outbox import LEASE
from portal.tasks import send_mail as outbox_sweep
from tpus.models import Grant, IpChangeNotice
from tpus.services import inventory, reconcile, sync
from tpus.tasks import reconcile_sweep
from tpus.tests.jobs_support import make_vm

ROOT = Path(__file__).resolve().parents[2]

# Activates the VM's pending grants and dies right after the commit: the first
# callback after the commit is the process's end, before any email could be tried.
DIE_AFTER_COMMIT = """
import os, sys
import django

django.setup()
from django.db import transaction
from tpus.services import reconcile

with transaction.atomic():
    transaction.on_commit(lambda: os._exit(9))
    reconcile.settle_grants(int(sys.argv[1]))
"""


def _later(seconds: float) -> None:
    """``seconds`` pass, as far as the outbox can tell."""
    step = dt.timedelta(seconds=seconds)
    OutboxMessage.objects.update(
        created_at=F("created_at") - step, next_attempt_at=F("next_attempt_at") - step
    )


@pytest.mark.django_db(transaction=True)
def test_the_access_email_survives_the_death_of_the_process_that_activated_the_grant(
    settings, make_lab, make_user, add_member
):
    lab = make_lab("Vision", slug="vision")
    milo = make_user("milo@vision.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    vm = make_vm(lab, workers=0)
    grant = Grant.objects.create(user=milo, vm=vm, state="pending")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings.test",
        "PORTAL_TEST_DATABASE_NAME": connection.settings_dict["NAME"],
        "PORTAL_TEST_VAR_DIR": str(settings.VAR_DIR),
        "PYTHONPATH": str(ROOT),
    }
    died = subprocess.run(
        [sys.executable, "-c", DIE_AFTER_COMMIT, str(vm.pk)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert died.returncode == 9, died.stderr[-3000:]
    assert Grant.objects.get(pk=grant.pk).state == "active"
    [message] = OutboxMessage.objects.all()
    assert (message.kind, message.to, message.attempts) == ("access_active", milo.email, 0)

    outbox_sweep()  # the dead process's lease on its first attempt still holds
    assert mail.outbox == []
    _later(settings.PORTAL_MAIL_SWEEP_SECONDS)
    outbox_sweep()
    [sent] = mail.outbox
    assert sent.to == [milo.email] and sent.subject.endswith("You can now use tpu5 (Vision)")
    for _ in range(3):  # later sweeps, of the outbox and of stuck work, add nothing
        _later(settings.PORTAL_MAIL_RETRY_MAX_SECONDS)
        outbox_sweep()
        reconcile_sweep()
    assert len(mail.outbox) == 1
    assert OutboxMessage.objects.get().state == OutboxState.SENT


def test_the_ip_change_emails_are_in_the_outbox_with_the_new_address_even_if_nothing_runs_after(
    db, tpu_emulator, make_lab, make_user, add_member, settings
):
    project, zone = "vision-lab-1", "us-central1-f"
    lab = make_lab("Vision", slug="vision", gcp_project_id=project, zones=[zone])
    admin = make_user("boss@vision.example")
    tpu_emulator.controls.add_node(project, zone, "tpu5", workers=1, external_ips=["34.0.0.1"])
    [vm] = inventory.import_vms(admin, lab, [f"{zone}/tpu5"])
    people = ["milo@uni.example", "ada@uni.example"]
    for address in people:
        user = make_user(address)
        add_member(lab, user)
        choose_username(user, address.split("@")[0])
        Grant.objects.create(user=user, vm=vm, state="active")
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    sync.sync_inventory()  # nothing runs after its commit: no task, no first attempt
    assert IpChangeNotice.objects.filter(sent_at__isnull=False).count() == 2
    waiting = OutboxMessage.objects.filter(kind="ip_changed", state=OutboxState.PENDING)
    assert sorted(waiting.values_list("to", flat=True)) == sorted(people)

    _later(settings.PORTAL_MAIL_SWEEP_SECONDS)
    outbox_sweep()
    reconcile_sweep()  # finds no notice left to write
    _later(settings.PORTAL_MAIL_SWEEP_SECONDS)
    outbox_sweep()
    assert sorted(m.to[0] for m in mail.outbox) == sorted(people)
    assert all("35.9.9.9" in m.subject for m in mail.outbox)


def test_the_access_email_is_written_when_it_goes_out_and_not_sent_for_a_grant_revoked_before(
    db, settings, make_lab, make_user, add_member
):
    lab = make_lab("Vision", slug="vision")
    milo, nina = make_user("milo@vision.example"), make_user("nina@vision.example")
    for person, name in ((milo, "milo"), (nina, "nina")):
        add_member(lab, person)
        choose_username(person, name)
    vm = make_vm(lab, workers=0)
    kept = Grant.objects.create(user=milo, vm=vm, state="pending")
    gone = Grant.objects.create(user=nina, vm=vm, state="pending")
    reconcile.settle_grants(vm.pk)  # (no commit hook runs here: no attempt yet)
    assert set(Grant.objects.values_list("state", flat=True)) == {"active"}
    # The change committed with two rows and no text: the reads for it come later.
    stored = OutboxMessage.objects.order_by("to")
    assert [(m.kind, m.subject, m.body, m.render_with) for m in stored] == [
        ("access_active", "", "", "access_active")
    ] * 2
    Grant.objects.filter(pk=gone.pk).update(state="revoked")
    _later(LEASE.total_seconds() + 1)
    outbox_sweep()
    [sent] = mail.outbox
    assert sent.to == [milo.email] and sent.subject.endswith("You can now use tpu5 (Vision)")
    assert "Your unix username on it is milo." in sent.body
    states = dict(OutboxMessage.objects.values_list("to", "state"))
    assert states == {milo.email: OutboxState.SENT, nina.email: OutboxState.DROPPED}
    assert Grant.objects.get(pk=kept.pk).state == "active"

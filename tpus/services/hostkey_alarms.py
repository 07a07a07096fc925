"""A worker's host key alarm: raised when the worker presents a host key other than
the pinned one, or when the Cloud TPU API publishes one (``published_keys``); then
the admins look, and resume provisioning or re-pin.

The two are not alike. A key the worker **presents** differently stops it: the
connection checks the pinned key before any credential is sent, so nothing reaches
it until it presents the pinned key again or an admin re-pins. A key only
**published** differently (guest attributes, which any process on the VM may write)
stops nothing: the pinned key still protects every connection, and a worker whose
published keys were rewritten must still be reconciled, and revokes must still reach
it. The admins are told all the same, and again (at most once per
``PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS``) when the published keys change again; a
presented mismatch on a worker with a published alarm turns it into a stopping one,
told at once.

The alarm also ends by itself when the worker presents its pinned key again
(``tpus.services.reconcile``). An admin who has checked the worker (the impostor is
gone, the address is back) need not wait for the sweep: resuming clears the alarm and
reconciles now. Nothing here trusts a key: the reconcile still connects only with the
pinned keys, so a worker that still presents another key raises the alarm again.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Worker
from tpus.services import emails
from tpus.services.hosts import forget_connections, hosts_must_change


def raise_alarm(worker: Worker, presented: str, *, published: bool = False) -> bool:
    """Record that the worker presented another host key (``presented``; that stops
    it) or that the Cloud TPU API publishes one (``published``; the worker is still
    provisioned), and tell the lab's admins: once per alarm for a presented key, and
    for published keys at most once per ``PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS``.
    False when there was nothing new (that alarm, with that key, is up already)."""
    key = presented[:2000]
    now = timezone.now()
    with transaction.atomic():  # the alarm and the admins' email commit together
        row = (
            Worker.objects.select_for_update()
            .filter(pk=worker.pk)
            .values(
                "host_key_mismatch_at",
                "host_key_alarm_published",
                "presented_host_key",
                "host_key_alerted_at",
            )
            .first()
        )
        if row is None:
            return False
        up = row["host_key_mismatch_at"] is not None
        if up and not row["host_key_alarm_published"]:
            return False  # the worker is stopped already; the admins were told
        if up and published and row["presented_host_key"] == key:
            return False
        Worker.objects.filter(pk=worker.pk).update(
            host_key_mismatch_at=row["host_key_mismatch_at"] if up and published else now,
            presented_host_key=key,
            host_key_alarm_published=published,
        )
        if not published:  # the address reaches another machine now
            forget_connections(Worker.objects.filter(pk=worker.pk))
        how = "the Cloud TPU API publishes" if published else "it presented"
        audit.record(
            AuditAction.HOST_KEY_CHANGED,
            lab=worker.vm.lab,
            summary=f"{worker.alias}: {how} a host key that is not the pinned one",
            data={"worker": worker.pk, "presented": key, "published": published},
        )
        window = dt.timedelta(seconds=settings.PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS)
        last = row["host_key_alerted_at"]
        # A presented key, or a fresh alarm, is told at once; a published change while
        # an alarm about published keys is already up, at most once per window.
        if not (published and up) or last is None or last <= now - window:
            Worker.objects.filter(pk=worker.pk).update(host_key_alerted_at=now)
            emails.send_host_key_alert(worker.pk)
    return True


def resume_after_alarm(admin, worker: Worker, *, request=None) -> bool:
    """Clear the worker's alarm (audited) and reconcile its VM now. False, and nothing
    done, when there was no alarm."""
    with transaction.atomic():
        cleared = Worker.objects.filter(pk=worker.pk, host_key_mismatch_at__isnull=False).update(
            host_key_mismatch_at=None, presented_host_key="", host_key_alarm_published=False
        )
        if not cleared:
            return False
        audit.record(
            AuditAction.HOST_KEY_ALARM_CLEARED,
            actor=admin,
            lab=worker.vm.lab,
            summary=f"{worker.alias}: an admin resumed provisioning",
            data={"worker": worker.pk, "presented": worker.presented_host_key[:2000]},
            request=request,
        )
        hosts_must_change(worker.vm, f"{worker.alias}: host key alarm cleared")
    worker.refresh_from_db()
    return True

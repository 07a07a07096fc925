"""A worker's host key alarm: raised when the worker presents a host key other than
the pinned one, or when the Cloud TPU API publishes one (``published_keys``); then
the admins look, and resume provisioning or re-pin.

The alarm also ends by itself when the worker presents its pinned key again
(``tpus.services.reconcile``). An admin who has checked the worker (the impostor is
gone, the address is back) need not wait for the sweep: resuming clears the alarm and
reconciles now. Nothing here trusts a key: the reconcile still connects only with the
pinned keys, so a worker that still presents another key raises the alarm again.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Worker
from tpus.services import emails
from tpus.services.hosts import hosts_must_change


def raise_alarm(worker: Worker, presented: str, *, published: bool = False) -> bool:
    """Stop provisioning this worker and tell the lab's admins, once per alarm.
    ``presented`` is the key the worker presented, or (``published``) the key the
    Cloud TPU API now publishes for it. False when the alarm was already up."""
    with transaction.atomic():  # the alarm and the admins' email commit together
        updated = Worker.objects.filter(pk=worker.pk, host_key_mismatch_at=None).update(
            host_key_mismatch_at=timezone.now(), presented_host_key=presented[:2000]
        )
        if updated:
            how = "the Cloud TPU API publishes" if published else "it presented"
            audit.record(
                AuditAction.HOST_KEY_CHANGED,
                lab=worker.vm.lab,
                summary=f"{worker.alias}: {how} a host key that is not the pinned one",
                data={"worker": worker.pk, "presented": presented[:2000], "published": published},
            )
            emails.send_host_key_alert(worker.pk)
    return bool(updated)


def resume_after_alarm(admin, worker: Worker, *, request=None) -> bool:
    """Clear the worker's alarm (audited) and reconcile its VM now. False, and nothing
    done, when there was no alarm."""
    with transaction.atomic():
        cleared = Worker.objects.filter(pk=worker.pk, host_key_mismatch_at__isnull=False).update(
            host_key_mismatch_at=None, presented_host_key=""
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

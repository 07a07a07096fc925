"""Telling people when a TPU VM's address changed: exactly one email per affected
person per change, with the new address and their refreshed ssh config."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Grant, IpChange, IpChangeNotice, TpuVm
from tpus.models.grants import WANTED_STATES
from tpus.services import emails
from tpus.services.hosts import hosts_must_change


def announce(vm: TpuVm, changes: list[IpChange]) -> None:
    """Record the changes in the audit log and put one email per person who can log
    in to the VM in the outbox. Runs inside the sync's transaction, so the new address
    and its emails commit together."""
    users = {
        g.user_id: g.user
        for g in Grant.objects.filter(vm=vm, state__in=WANTED_STATES).select_related("user")
    }
    for change in changes:
        audit.record(
            AuditAction.IP_CHANGED,
            lab=vm.lab,
            summary=f"{change.worker.alias}: {change.old_ip or 'none'} → {change.new_ip}",
            data={"worker": change.worker_id, "old": change.old_ip, "new": change.new_ip},
        )
        for user in users.values():
            notice, created = IpChangeNotice.objects.get_or_create(change=change, user=user)
            if created:
                emails.send_ip_change_email(notice.pk)


# A notice's email is written with the change; one still unsent after this long was
# left by an earlier version that handed the email to a task, lost with the broker.
NOTICE_LOST_AFTER = dt.timedelta(minutes=5)


def notices_to_resend(limit: int = 500) -> list[int]:
    """Notices whose email was never written (an earlier version's task that Redis
    lost), for the sweep to write; the notice's claim keeps it to one email. Changes older than the
    outbox's give-up time are no longer news and are left alone."""
    now = timezone.now()
    oldest = now - dt.timedelta(seconds=settings.PORTAL_MAIL_GIVE_UP_SECONDS)
    return list(
        IpChangeNotice.objects.filter(
            sent_at=None, change__seen_at__lt=now - NOTICE_LOST_AFTER, change__seen_at__gte=oldest
        )
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )


def hosts_must_be_checked(vm: TpuVm, event: str) -> None:
    """After maintenance, a reboot or a new address, make sure users and mounts are
    still right on every worker (only if the VM has anything to keep right)."""
    if vm.grants.exists() or vm.attachments.exists():
        hosts_must_change(vm, event)

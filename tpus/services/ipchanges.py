"""Telling people when a TPU VM's address changed: exactly one email per affected
person per change, with the new address and their refreshed ssh config."""

from __future__ import annotations

from tpus import audit, notify
from tpus.models import AuditAction, Grant, IpChange, IpChangeNotice, TpuVm
from tpus.models.grants import WANTED_STATES


def announce(vm: TpuVm, changes: list[IpChange]) -> None:
    """Record the changes in the audit log and queue one notice per person who can
    log in to the VM. Runs inside the sync's transaction."""
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
                notify.ip_changed(notice)


def request_reconcile_after_event(vm: TpuVm) -> None:
    """After maintenance, a reboot or a new address, make sure users and mounts are
    still right on every worker (only if the VM has anything to keep right)."""
    if vm.grants.exists() or vm.attachments.exists():
        from tpus.services.access_changes import request_reconcile

        request_reconcile(vm)

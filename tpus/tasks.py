"""Celery tasks: thin wrappers that reload by id, check the row still calls for the
work, and call a service or send a message."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.urls import reverse
from django.utils import timezone

from portal import heartbeat, mail
from portal.celery import every
from tpus.models import Invite, Membership
from tpus.models.labs import MembershipState, Role

RETRY = {
    "autoretry_for": (OSError,),
    "retry_backoff": 2,
    "retry_backoff_max": 300,
    "retry_jitter": True,
    "max_retries": 6,
}


@shared_task(**RETRY)
def send_membership_email(membership_id: int, kind: str) -> None:
    """``requested`` tells the lab's admins; ``decided`` tells the person asking."""
    membership = Membership.objects.select_related("lab", "user").filter(pk=membership_id).first()
    if membership is None:
        return
    lab = membership.lab
    if kind == "requested":
        if membership.state != MembershipState.REQUESTED:
            return  # decided before the mail went out; nothing to ask anymore
        admins = lab.memberships.filter(
            state=MembershipState.APPROVED, role=Role.ADMIN
        ).select_related("user")
        mail.send(
            "membership_requested",
            [m.user.email for m in admins],
            {"membership": membership, "lab": lab, "url": reverse("lab_admin", args=[lab.slug])},
        )
    elif kind == "decided":
        if membership.state not in {MembershipState.APPROVED, MembershipState.REJECTED}:
            return
        mail.send(
            "membership_decided",
            [membership.user.email],
            {"membership": membership, "lab": lab, "url": reverse("lab_detail", args=[lab.slug])},
        )


@shared_task(**RETRY)
def send_invite_email(invite_id: int, raw_token: str) -> None:
    invite = Invite.objects.select_related("lab", "created_by").filter(pk=invite_id).first()
    if invite is None or not invite.is_usable or not invite.email:
        return
    mail.send(
        "invite",
        [invite.email],
        {"invite": invite, "lab": invite.lab, "url": reverse("invite", args=[raw_token])},
    )


@every(settings.PORTAL_HEARTBEAT_SECONDS, name="heartbeat")
@shared_task(ignore_result=True)
def record_heartbeat() -> None:
    """Proves beat and a worker are both running (shown to site admins)."""
    heartbeat.beat()


@every(settings.PORTAL_SYNC_SECONDS, name="sync-inventory")
@shared_task(ignore_result=True)
def sync_inventory() -> None:
    """Refresh every lab's TPU VMs: one ListNodes per (project, zone)."""
    from tpus.services.sync import sync_inventory as sync

    sync()


@shared_task(ignore_result=True)
def sync_lab_inventory(lab_id: int) -> None:
    from tpus.models import Lab
    from tpus.services.sync import sync_inventory as sync

    lab = Lab.objects.filter(pk=lab_id).first()
    if lab is not None:
        sync([lab])


# Backoff for workers that could not be reached: 2, 4, 8 … seconds (with jitter), then
# the grant fails and the admins hear of it; the periodic sweep keeps trying later.
RECONCILE_RETRIES = 6


@shared_task(bind=True, ignore_result=True, max_retries=RECONCILE_RETRIES)
def reconcile_vm(self, vm_id: int) -> None:
    """Make every worker of a VM match the database (see tpus.services.reconcile)."""
    from tpus.models import TpuVm
    from tpus.services import reconcile

    if not TpuVm.objects.filter(pk=vm_id).exists():
        return
    report = reconcile.reconcile_vm(vm_id)
    if report.busy or not report.retryable:
        return
    # Run in-process (no broker to come back through), or out of retries: the grants
    # fail with the reason now; the periodic sweep keeps trying the VM later.
    if self.request.is_eager or self.request.retries >= self.max_retries:
        reconcile.give_up(vm_id)
        return
    raise self.retry(countdown=_backoff(self.request.retries))


def _backoff(attempt: int) -> float:
    import random

    base = min(2 ** (attempt + 1), 300)
    return base / 2 + random.uniform(0, base / 2)  # noqa: S311 (jitter, not secrecy)


@every(settings.PORTAL_RECONCILE_SWEEP_SECONDS, name="reconcile-sweep")
@shared_task(ignore_result=True)
def reconcile_sweep() -> None:
    """Re-enqueue anything stuck (pending or revoking grants, workers behind), and
    reconcile every VM now and then so drift is found and mended."""
    from tpus.services.maintenance import vms_to_reconcile

    for vm_id in vms_to_reconcile():
        reconcile_vm.delay(vm_id)


@every(settings.PORTAL_EXPIRY_CHECK_SECONDS, name="expire-grants")
@shared_task(ignore_result=True)
def expire_grants() -> None:
    """Revoke expired grants; warn people a week before their access ends."""
    from tpus import notify
    from tpus.models import Grant
    from tpus.services import grants

    grants.expire_grants()
    for grant in grants.grants_expiring_soon():
        if Grant.objects.filter(pk=grant.pk, expiry_warned_at=None).update(
            expiry_warned_at=timezone.now()
        ):
            notify.expiry_warning(grant)


@shared_task(**RETRY)
def send_grant_email(grant_id: int, kind: str) -> None:
    """``active`` and ``revoked`` and ``expiring`` go to the person; ``failed`` to the
    lab's admins."""
    from tpus.models import Grant
    from tpus.services.sshconfig import snippet_for

    grant = (
        Grant.objects.select_related("user__unix_account", "vm__lab").filter(pk=grant_id).first()
    )
    if grant is None:
        return
    lab = grant.vm.lab
    context = {"grant": grant, "vm": grant.vm, "lab": lab}
    if kind == "active" and grant.state == "active":
        context["workers"] = grant.vm.workers.order_by("index")
        context["snippet"] = snippet_for(grant.user, [grant.vm])
        mail.send("access_active", [grant.user.email], context)
    elif kind == "revoked" and grant.state == "revoked":
        mail.send("access_revoked", [grant.user.email], context)
    elif kind == "expiring" and grant.is_wanted:
        mail.send("access_expiring", [grant.user.email], context)
    elif kind == "failed" and grant.state == "failed":
        mail.send("grant_failed", _admin_emails(lab), context)


def _admin_emails(lab) -> list[str]:
    return list(
        lab.memberships.filter(state=MembershipState.APPROVED, role=Role.ADMIN).values_list(
            "user__email", flat=True
        )
    )


@shared_task(**RETRY)
def send_host_key_alert(worker_id: int) -> None:
    from tpus.models import Worker

    worker = Worker.objects.select_related("vm__lab").filter(pk=worker_id).first()
    if worker is None or worker.host_key_mismatch_at is None:
        return
    mail.send(
        "host_key_changed",
        _admin_emails(worker.vm.lab),
        {"worker": worker, "vm": worker.vm, "lab": worker.vm.lab},
    )


@shared_task(**RETRY)
def send_ip_change_email(notice_id: int) -> None:
    """One person, one change, one email: the notice is claimed before sending and
    released again only if sending failed, so a retry cannot send it twice."""
    from tpus.models import IpChangeNotice
    from tpus.services import sshconfig

    claimed = IpChangeNotice.objects.filter(pk=notice_id, sent_at=None).update(
        sent_at=timezone.now()
    )
    if not claimed:
        return
    notice = IpChangeNotice.objects.select_related(
        "change__worker__vm__lab", "user__unix_account"
    ).get(pk=notice_id)
    vm = notice.change.worker.vm
    try:
        mail.send(
            "ip_changed",
            [notice.user.email],
            {
                "change": notice.change,
                "vm": vm,
                "lab": vm.lab,
                "snippet": sshconfig.snippet_for(notice.user, [vm]),
                "refresh_command": sshconfig.refresh_command(notice.user),
            },
        )
    except Exception:
        IpChangeNotice.objects.filter(pk=notice_id).update(sent_at=None)
        raise


@shared_task(**RETRY)
def send_drift_alert(worker_id: int, usernames: list[str]) -> None:
    from tpus.models import Worker

    worker = Worker.objects.select_related("vm__lab").filter(pk=worker_id).first()
    if worker is None:
        return
    mail.send(
        "drift_found",
        _admin_emails(worker.vm.lab),
        {"worker": worker, "vm": worker.vm, "lab": worker.vm.lab, "usernames": usernames},
    )


@shared_task(ignore_result=True)
def run_disk_operation(operation_id: int) -> None:
    """Attach or detach a disk through the API's long-running operation."""
    from tpus.services.disk_operations import run_operation

    run_operation(operation_id)

"""Celery tasks: thin wrappers that reload by id, check the row still calls for the
work, and call a service or send a message."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.urls import reverse

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

"""The emails a lab's people and admins get: who receives each, what it says, and
whether the news still holds. The services call these in the transaction of the change
an email tells of (a grant turning active, an address changing, a job ending …), so
the message is in the outbox exactly when the change is committed: no task to lose,
no worker's death to wait out. Each function takes ids, reloads the rows, and stores
the message in the current transaction (``portal.mail``); nothing is sent about a row
that is gone or whose state moved on."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from portal import mail
from tpus.models import Grant, Invite, IpChangeNotice, Job, Membership, Worker, ZoneSync
from tpus.models.jobs import first_failed
from tpus.models.labs import MembershipState, Role
from tpus.services import sshconfig


def admin_emails(lab) -> list[str]:
    """The addresses of the lab's approved admins."""
    return list(
        lab.memberships.filter(state=MembershipState.APPROVED, role=Role.ADMIN).values_list(
            "user__email", flat=True
        )
    )


def send_membership_email(membership_id: int, kind: str) -> None:
    """``requested`` tells the lab's admins; ``decided`` tells the person asking."""
    membership = Membership.objects.select_related("lab", "user").filter(pk=membership_id).first()
    if membership is None:
        return
    lab = membership.lab
    if kind == "requested":
        if membership.state != MembershipState.REQUESTED:
            return  # decided before the mail went out; nothing to ask anymore
        mail.send(
            "membership_requested",
            admin_emails(lab),
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


def send_invite_email(invite_id: int, raw_token: str) -> None:
    invite = Invite.objects.select_related("lab", "created_by").filter(pk=invite_id).first()
    if invite is None or not invite.is_usable or not invite.email:
        return
    mail.send(
        "invite",
        [invite.email],
        {"invite": invite, "lab": invite.lab, "url": reverse("invite", args=[raw_token])},
    )


def send_access_active(grant: Grant) -> None:
    """The "You can now use …" email, with the VM's workers, ssh config lines and known_hosts:
    stored with the grant's change and written at its first attempt (right after the
    commit), so the change commits without the reads the text needs
    (``access_active_context``). ``grant``: with its user."""
    mail.send_later("access_active", [grant.user.email], {"grant": grant.pk})


def access_active_context(args: dict) -> dict | None:
    """The context of the "You can now use …" email of ``args["grant"]``, or None when
    the grant is no longer in force (the email is then not sent)."""
    grant = (
        Grant.objects.select_related("user__unix_account", "vm__lab")
        # The list, the config lines and known_hosts all read the VM's workers: once.
        .prefetch_related("vm__workers")
        .filter(pk=args["grant"], state="active")
        .first()
    )
    if grant is None:
        return None
    among = sshconfig.naming_peers(grant.user)
    return {
        "grant": grant,
        "vm": grant.vm,
        "lab": grant.vm.lab,
        "workers": sorted(grant.vm.workers.all(), key=lambda w: w.index),
        # The same lines as the downloaded config and known_hosts, for this VM.
        "snippet": sshconfig.snippet_for(grant.user, [grant.vm], among=among),
        "known_hosts": sshconfig.render_known_hosts([grant.vm], among=among),
        "host": sshconfig.host_name_for(grant.user, grant.vm, among=among),
        "config_path": sshconfig.CONFIG_PATH,
        "known_hosts_path": sshconfig.KNOWN_HOSTS_PATH,
    }


def send_grant_email(grant_id: int, kind: str) -> None:
    """``active`` and ``revoked`` and ``expiring`` go to the person; ``failed`` to the
    lab's admins."""
    grants = Grant.objects.select_related("user__unix_account", "vm__lab")
    grant = grants.filter(pk=grant_id).first()
    if grant is None:
        return
    lab = grant.vm.lab
    context = {"grant": grant, "vm": grant.vm, "lab": lab}
    if kind == "active" and grant.state == "active":
        send_access_active(grant)
    elif kind == "revoked" and grant.state == "revoked":
        mail.send("access_revoked", [grant.user.email], context)
    elif kind == "expiring" and grant.is_wanted:
        mail.send("access_expiring", [grant.user.email], context)
    elif kind == "failed" and grant.state == "failed":
        mail.send("grant_failed", admin_emails(lab), context)


def send_host_key_alert(worker_id: int) -> None:
    worker = Worker.objects.select_related("vm__lab").filter(pk=worker_id).first()
    if worker is None or worker.host_key_mismatch_at is None:
        return
    mail.send(
        "host_key_changed",
        admin_emails(worker.vm.lab),
        {
            "worker": worker,
            "vm": worker.vm,
            "lab": worker.vm.lab,
            "published": bool(worker.published_key_changes()),
        },
    )


def send_sync_alert(zone_sync_id: int, kind: str, failing_since: str) -> None:
    """``failing``: listing a zone of the lab has failed for too long; ``recovered``:
    it works again. Each was claimed once by the sync that saw it; a message whose
    news is already stale (it recovered before the mail went out) is not sent."""
    row = ZoneSync.objects.select_related("lab").filter(pk=zone_sync_id).first()
    if row is None:
        return
    if kind == "failing" and row.alerted_at is not None:
        mail.send("sync_failing", admin_emails(row.lab), {"sync": row, "lab": row.lab})
    elif kind == "recovered" and row.alerted_at is None:
        since = datetime.fromisoformat(failing_since) if failing_since else None
        mail.send(
            "sync_recovered",
            admin_emails(row.lab),
            {"sync": row, "lab": row.lab, "failing_since": since},
        )


def send_ip_change_email(notice_id: int) -> None:
    """One person, one change, one email: claiming the notice and storing the message
    in the outbox commit together (or not at all), and the outbox delivers it."""
    with transaction.atomic():
        claimed = IpChangeNotice.objects.filter(pk=notice_id, sent_at=None).update(
            sent_at=timezone.now()
        )
        if not claimed:
            return
        notice = IpChangeNotice.objects.select_related(
            "change__worker__vm__lab", "user__unix_account"
        ).get(pk=notice_id)
        vm = notice.change.worker.vm
        mail.send(
            "ip_changed",
            [notice.user.email],
            {
                "change": notice.change,
                "vm": vm,
                "lab": vm.lab,
                "snippet": sshconfig.snippet_for(notice.user, [vm]),
                # The refresh URL is a password: the email points to the page instead.
                "has_refresh_url": sshconfig.feed_urls(notice.user) is not None,
            },
        )


def send_drift_alert(worker_id: int, usernames: list[str]) -> None:
    worker = Worker.objects.select_related("vm__lab").filter(pk=worker_id).first()
    if worker is None:
        return
    mail.send(
        "drift_found",
        admin_emails(worker.vm.lab),
        {"worker": worker, "vm": worker.vm, "lab": worker.vm.lab, "usernames": usernames},
    )


def send_job_email(job_id: int) -> None:
    """How a job ended, to the person who ran it: once (claimed with ``notified_at``),
    with each worker's exit and the last lines of the log that tells most."""
    with transaction.atomic():
        claimed = Job.objects.filter(pk=job_id, notified_at=None, ended_at__isnull=False).update(
            notified_at=timezone.now()
        )
        if not claimed:
            return
        job = Job.objects.select_related("vm__lab", "user").get(pk=job_id)
        parts = list(job.parts.all())
        # The worker that failed first tells most; else worker 0.
        telling = first_failed(parts, job.ended_at) or (parts[0] if parts else None)
        tail = ""
        if telling is not None:
            tail = "\n".join(telling.log_tail.splitlines()[-20:])
        mail.send(
            "job_ended",
            [job.user.email],
            {
                "job": job,
                "vm": job.vm,
                "lab": job.vm.lab,
                "parts": parts,
                "telling": telling,
                "tail": tail,
                "path": reverse("job_detail", args=[job.vm.lab.slug, job.vm_id, job.pk]),
            },
        )


def send_job_moved(job_id: int) -> None:
    """A pool job run again after its VM was lost, placed on another VM of its kind:
    its owner hears where it went ("tpu7 was preempted; your job moved to tpu3"), in
    the transaction that placed it."""
    job = (
        Job.objects.select_related("vm__lab", "user")
        .filter(pk=job_id, vm__isnull=False, returned_at__isnull=False)
        .first()
    )
    if job is None:
        return
    mail.send(
        "job_moved",
        [job.user.email],
        {
            "job": job,
            "vm": job.vm,
            "lab": job.vm.lab,
            "path": reverse("job_detail", args=[job.vm.lab.slug, job.vm_id, job.pk]),
        },
    )


def send_vm_back(vm_id: int) -> None:
    """A VM kept alive is up again after Google took it back: one message to each
    person with access, who can log in as before (the same name in their config)."""
    from tpus.models import TpuVm
    from tpus.models.grants import GrantState

    vm = TpuVm.objects.select_related("lab").filter(pk=vm_id).first()
    if vm is None:
        return
    workers = list(vm.workers.order_by("index"))
    for grant in vm.grants.filter(state=GrantState.ACTIVE).select_related("user"):
        mail.send("vm_back", [grant.user.email], {"vm": vm, "lab": vm.lab, "workers": workers})


def send_vm_request_failed(request_id: int) -> None:
    """A request for a TPU VM failed: the lab's admins hear why, once."""
    from tpus.models import VmRequest

    made = VmRequest.objects.select_related("lab").filter(pk=request_id).first()
    if made is None or made.state != "failed":
        return
    mail.send("vm_request_failed", admin_emails(made.lab), {"request": made, "lab": made.lab})


def send_vm_kept_down(request_id: int) -> None:
    """A VM kept alive that Google took back is not asked for again (its chips are not
    free, or the lab's grant ended): the lab's admins hear why, once a spell."""
    from tpus.models import VmRequest

    made = VmRequest.objects.select_related("lab", "vm").filter(pk=request_id).first()
    if made is None or not made.kept_down or made.vm is None:
        return
    context = {
        "request": made,
        "vm": made.vm,
        "lab": made.lab,
        "poll_seconds": settings.PORTAL_VM_REQUEST_POLL_SECONDS,
    }
    mail.send("vm_kept_down", admin_emails(made.lab), context)


def send_vm_deleted(vm_id: int, admin_id: int) -> None:
    """The lab's admins delete a VM: each person with access hears it once, before it
    is gone, with what goes with it (their home there)."""
    from accounts.models import User
    from tpus.models import TpuVm
    from tpus.models.grants import WANTED_STATES

    vm = TpuVm.objects.select_related("lab").filter(pk=vm_id).first()
    if vm is None:
        return
    admin = User.objects.filter(pk=admin_id).first()
    for grant in vm.grants.filter(state__in=WANTED_STATES).select_related("user"):
        mail.send("vm_deleted", [grant.user.email], {"vm": vm, "lab": vm.lab, "admin": admin})


def send_grant_ending(lab_id: int, holding: list[dict]) -> None:
    """The lab's TPU grant ends within a week: its admins hear it once."""
    from tpus.models import Lab

    lab = Lab.objects.filter(pk=lab_id).first()
    if lab is None or lab.grant_end_date is None:
        return
    days = (lab.grant_end_date - timezone.localdate()).days
    mail.send(
        "lab_grant_ending",
        admin_emails(lab),
        {"lab": lab, "days": days, "holding": holding, "vms": lab.vms.filter(missing_since=None)},
    )


def send_idle_email(holding_id: int, kind: str) -> None:
    """The lab's policy on idle chips: ``warned`` tells the holder what they hold idle
    and since when; ``admins`` tells the lab's admins; ``released`` tells the holder
    the chips were released. Nobody is told of a holding that is gone or busy again."""
    from tpus.models import IdleHolding

    row = IdleHolding.objects.select_related("vm__lab", "person", "job").filter(pk=holding_id)
    row = row.first()
    if row is None or row.idle_since is None:
        return
    lab = row.vm.lab
    context = {
        "row": row,
        "vm": row.vm,
        "lab": lab,
        "hbm_gib": f"{row.hbm_used / 1024**3:.1f}",
        "chips": ", ".join(f"worker {w} chip {c}" for w, c in row.chips) or "its chips",
        "path": reverse("vm_jobs", args=[lab.slug, row.vm_id]),
        "release": lab.idle_release,
        "admins_minutes": lab.idle_admins_minutes,
        "threshold": lab.idle_threshold_percent,
    }
    if kind == "admins":
        mail.send("idle_admins", admin_emails(lab), context)
    elif kind in ("warned", "released") and row.person is not None:
        mail.send(f"idle_{kind}", [row.person.email], context)

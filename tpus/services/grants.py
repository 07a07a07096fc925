"""Use cases about access to TPU VMs: grant, revoke, retry, expire.

Each changes desired state in the database, bumps the VM's desired version, and asks
for a reconcile after commit; the reconcile makes the hosts match. Clicking "grant"
fifty times gives one grant and one consistent result.
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Grant, KindGrant, Lab, Membership, TpuVm
from tpus.models.grants import WANTED_STATES, GrantState, KindGrantState
from tpus.models.labs import MembershipState
from tpus.services import emails, jobs
from tpus.services.hosts import hosts_must_change


class GrantError(ValueError):
    """A grant use case refused; the message is for the admin."""


def why_not_grantable(lab: Lab, membership: Membership | None) -> str:
    """Why this person cannot be given access in ``lab`` yet ("" when they can): an
    approved member who accepted the current policy and chose a unix username."""
    if membership is None:
        return f"That person is not a member of {lab.name}."
    email = membership.user.email
    if membership.state != MembershipState.APPROVED:
        state = {
            MembershipState.REQUESTED: "their request to join is waiting for approval",
            MembershipState.REJECTED: "their request to join was rejected",
            MembershipState.REMOVED: "they were removed from the lab",
        }.get(membership.state, membership.state)
        return f"{email} is not an approved member of {lab.name}: {state}."
    if membership.policy_version_accepted != lab.policy_version:
        return f"{email} has not accepted the lab's current policy yet."
    account = getattr(membership.user, "unix_account", None)
    if account is None or not account.username:
        return (
            f"{email} has not chosen a unix username yet; they choose one on their SSH keys page."
        )
    return ""


def check_person(lab: Lab, user, expires_on: dt.date | None) -> None:
    """Refuse (``GrantError``) to give ``user`` access in ``lab`` until ``expires_on``
    when they may not have it: the checks of every grant that are not about a VM."""
    membership = (
        Membership.objects.filter(lab=lab, user=user).select_related("user__unix_account").first()
    )
    problem = why_not_grantable(lab, membership)
    if problem:
        raise GrantError(problem if membership else f"{user.email} is not a member of {lab.name}.")
    today = timezone.localdate()
    if expires_on is not None and expires_on <= today:
        raise GrantError("The expiry date must be in the future.")
    if lab.grant_end_date and lab.grant_end_date <= today:
        raise GrantError(f"{lab.name}'s TPU grant ended on {lab.grant_end_date:%d %b %Y}.")
    if lab.grant_end_date and expires_on and expires_on > lab.grant_end_date:
        raise GrantError(
            f"Access cannot outlast the lab's TPU grant ({lab.grant_end_date:%d %b %Y})."
        )


def _check_grantable(lab: Lab, user, vms: list[TpuVm], expires_on: dt.date | None) -> None:
    check_person(lab, user, expires_on)
    if not vms:
        raise GrantError("Choose at least one TPU VM.")
    for vm in vms:
        if vm.lab_id != lab.pk:
            raise GrantError(f"{vm.name} is not one of {lab.name}'s TPU VMs.")
        workers = list(vm.workers.all())
        if not workers:
            raise GrantError(f"{vm.name} has no workers registered.")
        unpinned = [w.alias for w in workers if not w.is_pinned]
        if unpinned:
            raise GrantError(
                f"{vm.name} has workers without pinned host keys ({', '.join(unpinned)}); "
                "confirm them on the VM's page first."
            )


def grant_access(
    admin,
    lab: Lab,
    user,
    vms: list[TpuVm],
    *,
    sudo: bool,
    expires_on: dt.date | None = None,
    from_kind: KindGrant | None = None,
    request=None,
) -> list[Grant]:
    """Give ``user`` access to each of ``vms``. Granting what is already granted with
    the same options changes nothing.

    With ``from_kind`` the grants are that kind grant's: a grant the person holds on a
    VM by hand stays as the admin gave it (and is not in the result). Without it the
    grant is a hand grant, also where a kind grant had made it: revoking the kind
    grant then leaves it."""
    _check_grantable(lab, user, vms, expires_on)
    grants = []
    for vm in vms:
        with transaction.atomic():
            TpuVm.objects.select_for_update().filter(pk=vm.pk).first()  # one change at a time
            grant = Grant.objects.filter(user=user, vm=vm).first()
            kind_id = from_kind.pk if from_kind else None
            if kind_id and grant is not None and grant.is_wanted and grant.from_kind_id != kind_id:
                continue
            unchanged = (
                grant is not None
                and grant.state in (GrantState.PENDING, GrantState.ACTIVE)
                and (grant.sudo, grant.expires_on) == (sudo, expires_on)
            )
            if unchanged:
                if grant.from_kind_id != kind_id:
                    _take_by_hand(admin, grant, request=request)
                grants.append(grant)
                continue
            grant = grant or Grant(user=user, vm=vm, created_by=admin)
            grant.from_kind = from_kind
            grant.sudo, grant.expires_on = sudo, expires_on
            grant.state, grant.error = GrantState.PENDING, ""
            grant.version = hosts_must_change(vm, f"access granted to user {user.pk}")
            grant.changed_at = timezone.now()
            grant.revoked_at = grant.revoked_by = grant.expiry_warned_at = None
            grant.save()
            audit.record(
                AuditAction.GRANT_CREATED,
                actor=admin,
                lab=lab,
                target_user=user,
                summary=f"{vm.name}{' with sudo' if sudo else ''}"
                + (f" until {expires_on:%Y-%m-%d}" if expires_on else "")
                + (f", from the {from_kind.accelerator_type} grant" if from_kind else ""),
                data={"vm": vm.pk, "grant": grant.pk, "sudo": sudo, "from_kind": kind_id},
                request=request,
            )
            grants.append(grant)
    return grants


def _take_by_hand(admin, grant: Grant, *, request=None) -> None:
    """A grant a kind grant made, given again by hand with the same options: the hosts
    need nothing, but it is now the admin's, and revoking the kind leaves it."""
    kind = grant.from_kind
    grant.from_kind, grant.changed_at = None, timezone.now()
    grant.save(update_fields=["from_kind", "changed_at"])
    audit.record(
        AuditAction.GRANT_CREATED,
        actor=admin,
        lab=grant.vm.lab,
        target_user=grant.user,
        summary=f"{grant.vm.name}, now by hand (it came from the {kind.accelerator_type} grant)",
        data={"vm": grant.vm_id, "grant": grant.pk, "sudo": grant.sudo},
        request=request,
    )


def revoke_access(actor, grant: Grant, *, reason: str = "", request=None) -> Grant:
    """Take access away: keys removed, account locked and expired, processes killed
    on every worker. Revoking a revoked grant changes nothing."""
    with transaction.atomic():
        vm = TpuVm.objects.select_for_update().get(pk=grant.vm_id)
        grant = Grant.objects.select_for_update().get(pk=grant.pk)
        if grant.state in (GrantState.REVOKING, GrantState.REVOKED):
            return grant
        grant.state = GrantState.REVOKING
        grant.version = hosts_must_change(vm, f"grant {grant.pk} revoked")
        grant.changed_at = timezone.now()
        grant.revoked_by = actor
        grant.error = ""
        grant.save()
        audit.record(
            AuditAction.GRANT_REVOKED,
            actor=actor,
            lab=vm.lab,
            target_user=grant.user,
            summary=f"{vm.name}{': ' + reason if reason else ''}",
            data={"vm": vm.pk, "grant": grant.pk},
            request=request,
        )
        # Jobs run as the person: those waiting end, a running one is stopped.
        jobs.cancel_jobs_of(grant.user, vm, f"Access to {vm.name} was revoked.")
    return grant


def retry_grant(admin, grant: Grant, *, request=None) -> Grant:
    """Try a failed grant again."""
    with transaction.atomic():
        vm = TpuVm.objects.select_for_update().get(pk=grant.vm_id)
        grant = Grant.objects.select_for_update().get(pk=grant.pk)
        if grant.state != GrantState.FAILED:
            return grant
        grant.state, grant.error = GrantState.PENDING, ""
        grant.retry_at, grant.failures = None, 0
        grant.version = hosts_must_change(vm, f"grant {grant.pk} retried")
        grant.changed_at = timezone.now()
        grant.save()
    return grant


def end_kind_grants(actor, kinds, *, reason: str, request=None) -> list[int]:
    """Mark the active ones of ``kinds`` (a KindGrant queryset) revoked, each audited,
    so no VM gets their grants any more; returns their ids. The VM grants they made
    are the caller's to revoke."""
    ended = []
    for kind in kinds.filter(state=KindGrantState.ACTIVE).select_related("lab", "user"):
        now = timezone.now()
        with transaction.atomic():
            if not KindGrant.objects.filter(pk=kind.pk, state=KindGrantState.ACTIVE).update(
                state=KindGrantState.REVOKED, revoked_at=now, revoked_by=actor, changed_at=now
            ):
                continue  # revoked meanwhile
            audit.record(
                AuditAction.KIND_GRANT_REVOKED,
                actor=actor,
                lab=kind.lab,
                target_user=kind.user,
                summary=f"every {kind.accelerator_type}{': ' + reason if reason else ''}",
                data={"kind_grant": kind.pk, "accelerator_type": kind.accelerator_type},
                request=request,
            )
        ended.append(kind.pk)
    return ended


def revoke_all_in_lab(actor, lab: Lab, user, *, reason: str, request=None) -> int:
    """Revoke every grant ``user`` holds on ``lab``'s VMs and every kind grant they
    hold in ``lab`` (removal from the lab)."""
    end_kind_grants(
        actor, KindGrant.objects.filter(lab=lab, user=user), reason=reason, request=request
    )
    grants = Grant.objects.filter(vm__lab=lab, user=user, state__in=WANTED_STATES)
    count = 0
    for grant in grants:
        revoke_access(actor, grant, reason=reason, request=request)
        count += 1
    return count


def expire_grants(today: dt.date | None = None) -> int:
    """Revoke grants and kind grants past their expiry date and all those of labs
    whose TPU grant ended (with a kind grant, the VM grants it made). Run
    periodically; running twice revokes nothing more. Returns how many VM grants."""
    today = today or timezone.localdate()
    kinds = KindGrant.objects.filter(expires_on__lt=today) | KindGrant.objects.filter(
        lab__grant_end_date__lt=today
    )
    end_kind_grants(None, kinds, reason="expired")
    due = (
        Grant.objects.filter(state__in=WANTED_STATES, expires_on__lt=today)
        | Grant.objects.filter(state__in=WANTED_STATES, vm__lab__grant_end_date__lt=today)
        | Grant.objects.filter(state__in=WANTED_STATES, from_kind__state=KindGrantState.REVOKED)
    )
    count = 0
    for grant in due.select_related("vm__lab").distinct():
        ended = grant.vm.lab.grant_end_date and grant.vm.lab.grant_end_date < today
        revoke_access(None, grant, reason="the lab's TPU grant ended" if ended else "expired")
        count += 1
    return count


def grants_expiring_soon(days: int = 7, today: dt.date | None = None):
    """Wanted grants ending within ``days`` whose holder has not been warned yet."""
    today = today or timezone.localdate()
    horizon = today + dt.timedelta(days=days)
    by_grant = Grant.objects.filter(
        state__in=WANTED_STATES, expiry_warned_at=None, expires_on__lte=horizon
    )
    by_lab = Grant.objects.filter(
        state__in=WANTED_STATES, expiry_warned_at=None, vm__lab__grant_end_date__lte=horizon
    )
    return (by_grant | by_lab).select_related("user", "vm__lab").distinct()


def warn_expiring_grants() -> int:
    """Email each person once, a week before a grant of theirs ends: the warning is
    claimed with a conditional UPDATE, so two runs never both send it."""
    warned = 0
    for grant in grants_expiring_soon():
        with transaction.atomic():  # the claim and the email commit together
            if Grant.objects.filter(pk=grant.pk, expiry_warned_at=None).update(
                expiry_warned_at=timezone.now()
            ):
                emails.send_grant_email(grant.pk, "expiring")
                warned += 1
    return warned

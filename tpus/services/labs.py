"""Use cases about labs and who belongs to them. Views, the API and the admin all call
these; each checks its own preconditions, so no caller can skip a rule."""

from __future__ import annotations

import datetime as dt

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal import audit
from portal.validators import validate_multiline_text, validate_plain_text
from tpus.models import AuditAction, Invite, Lab, Membership
from tpus.models.labs import MembershipState, Role, hash_invite_token
from tpus.services import emails, idle_exemptions, snapshots

PURPOSE_MAX = 500
INVITE_DAYS = 14
# A lab's fields that only a site admin sets: the project and zones decide whose TPU
# VMs the lab can import and log in to; the grant's end date comes from the lab's TPU
# grant, and ends (or, moved later, gives back) everyone's access to the lab's VMs and
# the right to make or start them.
SITE_ADMIN_FIELDS = ("gcp_project_id", "zones", "grant_end_date")
# The settings form's exemptions from the policy on idle chips: the memberships and the
# VMs exempted (not fields of the lab; ``idle_exemptions.set_exemptions``).
IDLE_EXEMPTION_FIELDS = ("idle_exempt_people", "idle_exempt_vms")
SITE_ADMIN_ONLY = (
    "Only a site admin can change a lab's GCP project, zones or TPU grant end date: ask one."
)


class LabError(ValueError):
    """A lab use case refused what was asked; the message says why, for people."""


def _clean_text(value: str, *, field: str, max_length: int, multiline: bool = False) -> str:
    value = (value or "").strip()
    if len(value) > max_length:
        raise LabError(f"{field} can be at most {max_length} characters.")
    try:
        (validate_multiline_text if multiline else validate_plain_text)(value)
    except ValidationError as exc:
        raise LabError(f"{field}: {exc.messages[0]}") from None
    return value


# --- Joining -------------------------------------------------------------------------


@transaction.atomic
def request_membership(
    user, lab: Lab, *, purpose: str, accept_policy: bool, request=None
) -> Membership:
    """Ask to join a lab. The policy must be accepted; asking again while a request is
    pending or after approval changes nothing; after a rejection or removal it opens a
    new request."""
    purpose = _clean_text(purpose, field="Purpose", max_length=PURPOSE_MAX, multiline=True)
    if not purpose:
        raise LabError("Say in a sentence what you will use the lab's TPUs for.")
    if not accept_policy:
        raise LabError("You need to accept the lab's usage policy to join.")
    membership = Membership.objects.select_for_update().filter(user=user, lab=lab).first()
    if membership and membership.state in {MembershipState.REQUESTED, MembershipState.APPROVED}:
        return membership
    now = timezone.now()
    if membership is None:
        membership = Membership(user=user, lab=lab)
    membership.state = MembershipState.REQUESTED
    membership.role = Role.MEMBER
    membership.purpose = purpose
    membership.requested_at = now
    membership.decided_at = None
    membership.decided_by = None
    membership.decision_note = ""
    membership.policy_version_accepted = lab.policy_version
    membership.policy_accepted_at = now
    membership.changed_at = now
    try:
        with transaction.atomic():
            membership.save()
    except IntegrityError:
        # Two requests at once: the other one won, and it is the same request.
        return Membership.objects.get(user=user, lab=lab)
    with transaction.atomic():
        audit.record(
            AuditAction.MEMBERSHIP_REQUESTED,
            actor=user,
            lab=lab,
            target_user=user,
            summary=purpose[:200],
            request=request,
        )
        emails.send_membership_email(membership.pk, "requested")
    return membership


def _decide(admin, membership: Membership, state: str) -> bool:
    """Move a pending request to ``state``; False when someone else decided first."""
    now = timezone.now()
    updated = Membership.objects.filter(pk=membership.pk, state=MembershipState.REQUESTED).update(
        state=state, decided_at=now, decided_by=admin, changed_at=now
    )
    membership.refresh_from_db()
    return bool(updated)


@transaction.atomic
def approve_membership(admin, membership: Membership, *, request=None) -> Membership:
    """Approve a pending request. Approving an approved member is a no-op."""
    if membership.state == MembershipState.APPROVED:
        return membership
    if membership.state != MembershipState.REQUESTED:
        raise LabError("Only a pending request can be approved.")
    if _decide(admin, membership, MembershipState.APPROVED):
        audit.record(
            AuditAction.MEMBERSHIP_APPROVED,
            actor=admin,
            lab=membership.lab,
            target_user=membership.user,
            request=request,
        )
        emails.send_membership_email(membership.pk, "decided")
    return membership


@transaction.atomic
def reject_membership(admin, membership: Membership, *, note: str = "", request=None):
    """Reject a pending request, optionally saying why (the note goes in the email)."""
    note = _clean_text(note, field="Note", max_length=500, multiline=True)
    if membership.state == MembershipState.REJECTED:
        return membership
    if membership.state != MembershipState.REQUESTED:
        raise LabError("Only a pending request can be rejected.")
    if _decide(admin, membership, MembershipState.REJECTED):
        Membership.objects.filter(pk=membership.pk).update(decision_note=note)
        membership.decision_note = note
        audit.record(
            AuditAction.MEMBERSHIP_REJECTED,
            actor=admin,
            lab=membership.lab,
            target_user=membership.user,
            summary=note[:200],
            request=request,
        )
        emails.send_membership_email(membership.pk, "decided")
    return membership


@transaction.atomic
def set_role(admin, membership: Membership, role: str, *, request=None) -> Membership:
    """Make an approved member an admin or back. The last admin of a lab stays."""
    if role not in Role.values:
        raise LabError("Unknown role.")
    if not membership.is_approved:
        raise LabError("Only approved members have a role to change.")
    if membership.role == role:
        return membership
    lab = Lab.objects.select_for_update().get(pk=membership.lab_id)
    if role == Role.MEMBER and membership.role == Role.ADMIN:
        admins = lab.memberships.filter(state=MembershipState.APPROVED, role=Role.ADMIN)
        if admins.count() <= 1:
            raise LabError("A lab needs at least one admin; make someone else admin first.")
    Membership.objects.filter(pk=membership.pk).update(role=role, changed_at=timezone.now())
    membership.role = role
    audit.record(
        AuditAction.ROLE_CHANGED,
        actor=admin,
        lab=lab,
        target_user=membership.user,
        data={"role": role},
        request=request,
    )
    return membership


# --- Invites -------------------------------------------------------------------------


@transaction.atomic
def create_invite(
    admin, lab: Lab, *, email: str = "", role: str = Role.MEMBER, request=None
) -> tuple[Invite, str]:
    """Make an invite link. Returns the row and the secret token for the link; only
    its hash is stored."""
    from django.core.validators import validate_email

    email = (email or "").strip().lower()
    if email:
        try:
            validate_email(email)
        except ValidationError:
            raise LabError("That is not a valid email address.") from None
    if role not in Role.values:
        raise LabError("Unknown role.")
    raw = Invite.generate()
    invite = Invite.objects.create(
        lab=lab,
        email=email,
        role=role,
        digest=hash_invite_token(raw),
        created_by=admin,
        expires_at=timezone.now() + dt.timedelta(days=INVITE_DAYS),
    )
    audit.record(
        AuditAction.INVITE_CREATED,
        actor=admin,
        lab=lab,
        summary=email or "open link",
        data={"invite": invite.pk, "role": role},
        request=request,
    )
    if email:
        # Rendered here, in the invite's transaction: the secret link never travels
        # through the broker.
        emails.send_invite_email(invite.pk, raw)
    return invite, raw


def revoke_invite(admin, invite: Invite, *, request=None) -> None:
    updated = Invite.objects.filter(pk=invite.pk, used_at=None, revoked_at=None).update(
        revoked_at=timezone.now()
    )
    if updated:
        audit.record(
            AuditAction.INVITE_REVOKED,
            actor=admin,
            lab=invite.lab,
            data={"invite": invite.pk},
            request=request,
        )


def find_invite(raw: str) -> Invite | None:
    """The invite a link's token belongs to, usable or not; None for a bad token."""
    if not raw or len(raw) > 64:
        return None
    return Invite.objects.select_related("lab").filter(digest=hash_invite_token(raw)).first()


@transaction.atomic
def accept_invite(user, raw: str, *, accept_policy: bool, request=None) -> Membership:
    """Join a lab through an invite: approved at once, with the invite's role."""
    invite = find_invite(raw)
    if invite is None:
        raise LabError("This invite link is not valid.")
    invite = Invite.objects.select_for_update().get(pk=invite.pk)
    if not invite.is_usable:
        raise LabError("This invite has expired, was revoked, or has been used already.")
    if invite.email and invite.email.lower() != user.email.lower():
        raise LabError(f"This invite is for {invite.email}; sign in with that address to use it.")
    if not accept_policy:
        raise LabError("You need to accept the lab's usage policy to join.")
    now = timezone.now()
    lab = invite.lab
    membership, _ = Membership.objects.select_for_update().get_or_create(user=user, lab=lab)
    keep_admin = membership.is_admin
    membership.state = MembershipState.APPROVED
    membership.role = Role.ADMIN if keep_admin else invite.role
    membership.decided_at = now
    membership.decided_by = invite.created_by
    membership.policy_version_accepted = lab.policy_version
    membership.policy_accepted_at = now
    membership.changed_at = now
    membership.save()
    Invite.objects.filter(pk=invite.pk).update(used_at=now, used_by=user)
    audit.record(
        AuditAction.INVITE_ACCEPTED,
        actor=user,
        lab=lab,
        target_user=user,
        data={"invite": invite.pk, "role": membership.role},
        request=request,
    )
    return membership


# --- Policy and lab settings ------------------------------------------------------------


def accept_policy(user, membership: Membership, *, request=None) -> Membership:
    """Accept the current version of the lab's policy (after it changed)."""
    lab = membership.lab
    if membership.policy_version_accepted == lab.policy_version:
        return membership
    now = timezone.now()
    Membership.objects.filter(pk=membership.pk).update(
        policy_version_accepted=lab.policy_version, policy_accepted_at=now, changed_at=now
    )
    membership.policy_version_accepted = lab.policy_version
    membership.policy_accepted_at = now
    audit.record(
        AuditAction.POLICY_ACCEPTED,
        actor=user,
        lab=lab,
        target_user=user,
        data={"version": lab.policy_version},
        request=request,
    )
    return membership


def _save_lab(lab: Lab) -> None:
    """Validate and save; a project another lab took meanwhile is the same refusal
    as one it had before."""
    try:
        lab.full_clean()
        with transaction.atomic():
            lab.save()
    except ValidationError as exc:
        raise LabError(" ".join(exc.messages)) from None
    except IntegrityError:
        raise LabError(Lab._meta.get_field("gcp_project_id").error_messages["unique"]) from None


@transaction.atomic
def update_lab(admin, lab: Lab, changes: dict, *, request=None) -> Lab:
    """Change a lab's settings from already-validated form data (the exemptions from
    the policy on idle chips among them). A changed policy gets
    a new version, which members accept again. Only a site admin changes the lab's GCP
    project, zones and grant end date (``SITE_ADMIN_FIELDS``); the audit entry of a
    moved end date has the old date and the new."""
    lab = Lab.objects.select_for_update().get(pk=lab.pk)
    exempt = {k: changes[k] for k in IDLE_EXEMPTION_FIELDS if k in changes}
    changes = {k: v for k, v in changes.items() if k not in IDLE_EXEMPTION_FIELDS}
    if exempt:
        current = idle_exemptions.exempt_objects(lab)
        idle_exemptions.set_exemptions(
            admin,
            lab,
            exempt.get("idle_exempt_people", current[0]),
            exempt.get("idle_exempt_vms", current[1]),
            request=request,
        )
    changed = sorted(field for field, value in changes.items() if getattr(lab, field) != value)
    if not changed:
        return lab
    if not admin.is_site_admin and set(changed) & set(SITE_ADMIN_FIELDS):
        raise LabError(SITE_ADMIN_ONLY)
    data, summary = {"fields": changed}, ""
    if "grant_end_date" in changed:
        old, new = lab.grant_end_date, changes["grant_end_date"]
        data["grant_end_date"] = {"old": _iso(old), "new": _iso(new)}
        summary = f"TPU grant end date: {_day(old)} → {_day(new)}"
    for field in changed:
        setattr(lab, field, changes[field])
    if "policy_text" in changed:
        lab.policy_version += 1
    _save_lab(lab)
    audit.record(
        AuditAction.LAB_UPDATED, actor=admin, lab=lab, summary=summary, data=data, request=request
    )
    return lab


def _iso(day) -> str | None:
    return day.isoformat() if day else None


def _day(day) -> str:
    return f"{day:%-d %B %Y}" if day else "none"


@transaction.atomic
def create_lab(site_admin, *, admin_emails: list[str], request=None, **fields) -> Lab:
    """A site admin opens a lab and names its first admins (existing accounts)."""
    from accounts.models import User

    if not site_admin.is_site_admin:
        raise LabError("Only site admins can create labs.")
    admins = []
    for email in admin_emails:
        user = User.objects.filter(email__iexact=email.strip()).first()
        if user is None:
            raise LabError(f"No account uses {email.strip()}; they need to sign up first.")
        admins.append(user)
    if not admins:
        raise LabError("Name at least one lab admin.")
    lab = Lab(**fields)
    _save_lab(lab)
    now = timezone.now()
    for user in admins:
        Membership.objects.create(
            user=user,
            lab=lab,
            role=Role.ADMIN,
            state=MembershipState.APPROVED,
            decided_at=now,
            decided_by=site_admin,
            policy_version_accepted=lab.policy_version,
            policy_accepted_at=now,
        )
    audit.record(
        AuditAction.LAB_CREATED,
        actor=site_admin,
        lab=lab,
        data={"admins": [u.pk for u in admins]},
        request=request,
    )
    return lab


@transaction.atomic
def remove_member(admin, membership: Membership, *, request=None) -> Membership:
    """Take someone out of a lab. Their access to the lab's TPU VMs goes with it."""
    if membership.state == MembershipState.REMOVED:
        return membership
    if membership.is_admin:
        others = membership.lab.memberships.filter(
            state=MembershipState.APPROVED, role=Role.ADMIN
        ).exclude(pk=membership.pk)
        if not others.exists():
            raise LabError("A lab needs at least one admin; make someone else admin first.")
    now = timezone.now()
    Membership.objects.filter(pk=membership.pk).update(
        state=MembershipState.REMOVED, decided_at=now, decided_by=admin, changed_at=now
    )
    membership.refresh_from_db()
    from tpus.services.grants import revoke_all_in_lab

    revoke_all_in_lab(
        admin, membership.lab, membership.user, reason="removed from the lab", request=request
    )
    audit.record(
        AuditAction.MEMBERSHIP_REMOVED,
        actor=admin,
        lab=membership.lab,
        target_user=membership.user,
        request=request,
    )
    # What they stored in the lab goes with them (their jobs there were cancelled).
    snapshots.remove_snapshots_of(
        membership.user, membership.lab, "its owner was removed from the lab", actor=admin
    )
    return membership

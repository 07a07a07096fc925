"""Query filters the API's lab lists share. Each resolves a value within one lab and
answers 400 when it matches nothing there: a script that asks for a person, VM or zone
the lab does not have learns so, instead of getting an empty page. Another lab's
people and VMs are "not in this lab", exactly like ones that do not exist."""

from __future__ import annotations

from django.db.models import Exists, OuterRef, Q
from ninja.errors import HttpError

from accounts.models import User
from tpus.models import AuditEvent, Lab, Membership, TpuVm


def lab_member(lab: Lab, raw: str | None):
    """The person with this email or unix username who has (or had) a membership."""
    if raw is None or raw == "":
        return None
    value = raw.strip()
    membership = (
        lab.memberships.select_related("user")
        .filter(Q(user__email__iexact=value) | Q(user__unix_account__username=value))
        .first()
    )
    if membership is None:
        raise HttpError(400, f"user {raw!r} matches no email or unix username in {lab.name}.")
    return membership.user


def lab_actor(lab: Lab, raw: str | None):
    """Someone with this email or unix username who is or was in the lab, or who acted
    in it (a site admin). Anyone else is "not in this lab", whether or not they have
    an account."""
    if raw is None or raw == "":
        return None
    value = raw.strip()
    member = Membership.objects.filter(lab=lab, user=OuterRef("pk"))
    acted = AuditEvent.objects.filter(lab=lab, actor=OuterRef("pk"))
    person = (
        User.objects.filter(Q(email__iexact=value) | Q(unix_account__username=value))
        .filter(Exists(member) | Exists(acted))
        .first()
    )
    if person is None:
        raise HttpError(
            400, f"actor {raw!r} matches no email or unix username of anyone in {lab.name}."
        )
    return person


def lab_vm(lab: Lab, raw: str | None) -> TpuVm | None:
    """The lab's TPU VM with this id or name."""
    if raw is None or raw == "":
        return None
    value = raw.strip()
    match = Q(name=value) | Q(pk=int(value)) if value.isdigit() else Q(name=value)
    vm = lab.vms.filter(match).order_by("pk").first()
    if vm is None:
        raise HttpError(400, f"vm {raw!r} matches no TPU VM id or name in {lab.name}.")
    return vm


def lab_zone(lab: Lab, raw: str | None) -> str | None:
    """One of the lab's zones (configured, or where one of its VMs is)."""
    if raw is None or raw == "":
        return None
    value = raw.strip()
    if value not in (lab.zones or []) and not lab.vms.filter(zone=value).exists():
        raise HttpError(400, f"zone {raw!r} is not one of {lab.name}'s zones.")
    return value

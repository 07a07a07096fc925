"""API endpoints for what a lab admin does on the lab's admin pages: members' roles and
removal, the lab's settings, its audit log and invites; and, from
``tpus.api.admin_inventory``, what the lab's TPU VMs page does.

Each endpoint is its page's action through the API door: the same lookup in
``tpus.access`` (another lab's object is a 404; a member who is not an admin gets a
403 with the reason), the same Django form on the input (``tpus.api.forms``), and the
same service call."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db.models import Q, TextChoices
from django.db.models.functions import Lower
from django.forms.models import model_to_dict
from django.urls import reverse
from django.utils import timezone
from ninja import Query, Router, Schema, Status
from ninja.pagination import paginate

from portal.audit import AuditAction
from portal.pagination import KeysetPagination, parse_choice, parse_since
from tpus import access
from tpus.api import filters as api_filters
from tpus.api.admin_inventory import router as inventory_actions
from tpus.api.docs import PAGED, filter_help
from tpus.api.forms import FormError, StrictIn, refusal, refused
from tpus.api.labs import MembershipOut
from tpus.forms.labs import (
    InviteForm,
    LabSettingsForm,
    RoleForm,
    ShareForm,
    SiteLabSettingsForm,
)
from tpus.models import Membership, TpuVm
from tpus.models.labs import ZONE_PATTERN, Role
from tpus.services import fair_share, idle_exemptions
from tpus.services import labs as lab_services
from tpus.services.labs import LabError

router = Router(tags=["lab admin"])


# --- Members -------------------------------------------------------------------------


class RoleIn(StrictIn):
    role: str


@router.post(
    "/labs/{slug}/memberships/{membership_id}/role",
    response={200: MembershipOut, 400: FormError},
    summary="Make an approved member a lab admin, or an admin a member (lab admins)",
)
def set_role(request, slug: str, membership_id: int, payload: RoleIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = RoleForm(payload.dict())
    if not form.is_valid():
        return refused(form)
    try:
        lab_services.set_role(request.user, membership, form.cleaned_data["role"], request=request)
    except LabError as exc:
        return refusal(str(exc))
    return Status(200, membership)


class ShareIn(StrictIn):
    # A number from 0.01 to 1000, at most two decimals (a string keeps them exact).
    share: str | float


class ShareOut(Schema):
    user: str
    # Waiting pool jobs go in the order of recent use divided by the share.
    share: float
    # Chip-hours, each halved every half-life of the lab since it was used.
    recent_use: float
    # Chips the person's jobs hold now.
    running_chips: int


def _share_of(lab, membership) -> dict:
    standing = fair_share.standings(lab, [membership.user_id])[membership.user_id]
    return {
        "user": membership.user.email,
        "share": standing.share,
        "recent_use": round(standing.use, 3),
        "running_chips": standing.running_chips,
    }


@router.get(
    "/labs/{slug}/memberships/{membership_id}/share",
    response=ShareOut,
    summary="A member's share of the lab's pool, recent use and running chips (lab admins)",
)
def get_share(request, slug: str, membership_id: int):
    lab = access.get_admin_lab(request.user, slug)
    return _share_of(lab, access.get_membership_for_admin(request.user, lab, membership_id))


@router.post(
    "/labs/{slug}/memberships/{membership_id}/share",
    response={200: ShareOut, 400: FormError},
    summary="Set a member's share of the lab's pool (lab admins)",
)
def set_share(request, slug: str, membership_id: int, payload: ShareIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = ShareForm({"share": str(payload.share)})
    if not form.is_valid():
        return refused(form)
    fair_share.set_share(request.user, membership, form.cleaned_data["share"], request=request)
    return Status(200, _share_of(lab, membership))


@router.post(
    "/labs/{slug}/memberships/{membership_id}/remove",
    response={200: MembershipOut, 400: FormError},
    summary="Take someone out of the lab, revoking their access to its TPU VMs (lab admins)",
)
def remove_member(request, slug: str, membership_id: int):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    try:
        lab_services.remove_member(request.user, membership, request=request)
    except LabError as exc:
        return refusal(str(exc))
    return Status(200, membership)


# --- Settings ------------------------------------------------------------------------


class LabSettingsOut(Schema):
    name: str
    gcp_project_id: str
    zones: list[str]
    grant_end_date: date | None
    default_sudo: bool
    discoverable: bool
    policy_text: str
    # One more each time the policy text changes; members accept the new version.
    policy_version: int
    # Each job's cgroup on each worker; 0 memory: 90% of the worker's.
    job_tasks_max: int
    job_memory_max_mb: int
    job_log_max_mb: int
    # The most one workdir snapshot a job carries may hold (MB, files).
    snapshot_max_mb: int
    snapshot_max_files: int
    # The pool (jobs for any free VM of a kind): chips one person's jobs may hold at
    # once; 0: no limit.
    max_chips_per_person: int
    # Jobs one person may have waiting in the lab at once; 0: no limit.
    max_waiting_jobs_per_person: int
    # Fair share: a chip-hour used this many days ago counts half in the order of the
    # pool's waiting jobs.
    fair_share_half_life_days: float
    # API tokens its members make expire after this many days (the shortest of their labs').
    token_lifetime_days: int
    # The policy on idle chips (off by default): chips held with a duty cycle below the
    # threshold (percent) for the minutes to warn get their holder an email; the minutes
    # to admins after that, the lab's admins are told and, with release on, the portal
    # ends the job or process that holds them.
    idle_policy_enabled: bool
    idle_threshold_percent: float
    idle_warn_minutes: int
    idle_admins_minutes: int
    idle_release: bool
    # Left alone by that policy: people (their emails) and TPU VMs (their names).
    idle_exempt_people: list[str]
    idle_exempt_vms: list[str]

    @staticmethod
    def resolve_idle_exempt_people(lab) -> list[str]:
        return idle_exemptions.exemptions(lab)["idle_exempt_people"]

    @staticmethod
    def resolve_idle_exempt_vms(lab) -> list[str]:
        return idle_exemptions.exemptions(lab)["idle_exempt_vms"]


class LabSettingsIn(StrictIn):
    """The fields to change; those left out keep their value. ``gcp_project_id``,
    ``zones`` and ``grant_end_date`` are for site admins only (a lab admin's request
    that names one is a 403, whatever the value). A default of None means "not given": null is
    refused where the page's form has no empty choice."""

    name: str = None
    gcp_project_id: str = None
    zones: list[str] = None
    grant_end_date: date | None = None
    default_sudo: bool = None
    discoverable: bool = None
    policy_text: str = None
    job_tasks_max: int = None
    job_memory_max_mb: int = None
    job_log_max_mb: int = None
    snapshot_max_mb: int = None
    snapshot_max_files: int = None
    max_chips_per_person: int = None
    max_waiting_jobs_per_person: int = None
    fair_share_half_life_days: float = None
    token_lifetime_days: int = None
    idle_policy_enabled: bool = None
    idle_threshold_percent: float = None
    idle_warn_minutes: int = None
    idle_admins_minutes: int = None
    idle_release: bool = None
    # The whole list each: the people (emails of approved members) and VMs (names).
    idle_exempt_people: list[str] = None
    idle_exempt_vms: list[str] = None


def _exemption_ids(lab, given: dict[str, Any]) -> dict[str, list]:
    """The form's exemptions: the current ones, or the given emails and VM names as the
    page's ids (a name that is not the lab's stays as given, and the form refuses it)."""
    people, vms = idle_exemptions.exempt_objects(lab)
    ids = {"idle_exempt_people": [m.pk for m in people], "idle_exempt_vms": [v.pk for v in vms]}
    if "idle_exempt_people" in given:
        wanted = [str(e).strip().lower() for e in given["idle_exempt_people"]]
        found = dict(
            Membership.objects.filter(lab=lab)
            .annotate(email=Lower("user__email"))
            .filter(email__in=wanted)
            .values_list("email", "pk")
        )
        ids["idle_exempt_people"] = [found.get(e, e) for e in wanted]
    if "idle_exempt_vms" in given:
        wanted = [str(n) for n in given["idle_exempt_vms"]]
        found = {}
        for name, pk in TpuVm.objects.filter(lab=lab, name__in=wanted).values_list("name", "pk"):
            found.setdefault(name, []).append(pk)
        ids["idle_exempt_vms"] = [pk for n in wanted for pk in found.get(n, [n])]
    return ids


def _settings_form(request, lab, given: dict[str, Any]):
    """The page's settings form for this person, bound to the lab's current values
    with ``given`` on top (a partial change is the whole form with a few fields moved)."""
    form_class = SiteLabSettingsForm if request.user.is_site_admin else LabSettingsForm
    data = {
        **model_to_dict(lab, fields=form_class._meta.fields),
        **given,
        **_exemption_ids(lab, given),
    }
    if "zones" in data:
        data["zones"] = ", ".join(data["zones"])  # the page types them on one line
    return form_class(data, instance=lab)


@router.get(
    "/labs/{slug}/settings", response=LabSettingsOut, summary="A lab's settings (lab admins)"
)
def get_settings(request, slug: str):
    return access.get_admin_lab(request.user, slug)


@router.patch(
    "/labs/{slug}/settings",
    response={200: LabSettingsOut, 400: FormError},
    summary="Change a lab's settings (lab admins; the GCP project, zones and grant end date: "
    "site admins)",
)
def update_settings(request, slug: str, payload: LabSettingsIn):
    lab = access.get_admin_lab(request.user, slug)
    given = payload.dict(exclude_unset=True)
    if not request.user.is_site_admin and given.keys() & set(lab_services.SITE_ADMIN_FIELDS):
        raise PermissionDenied(lab_services.SITE_ADMIN_ONLY)
    form = _settings_form(request, lab, given)
    if form.is_valid() and "zones" in given and form.cleaned_data["zones"] != given["zones"]:
        # One item with two names in it (or none) would pass as their list on one line.
        form.add_error("zones", ZONE_PATTERN.message)
    if not form.is_valid():
        return refused(form)
    try:
        lab = lab_services.update_lab(request.user, lab, form.cleaned_data, request=request)
    except LabError as exc:
        return refusal(str(exc))
    return Status(200, lab)


# --- Audit log -----------------------------------------------------------------------


class AuditEventOut(Schema):
    id: int
    created_at: datetime
    action: str
    # What the page's "What" column says.
    action_label: str
    # Who did it: their email, or null for the portal itself.
    actor: str | None
    # Whom it concerned, when it concerned someone.
    user: str | None
    summary: str
    # Details such as ids and what a host answered; the keys depend on the action.
    data: dict[str, Any]
    ip_address: str | None

    @staticmethod
    def resolve_action_label(obj):
        return obj.get_action_display()

    @staticmethod
    def resolve_actor(obj):
        return obj.actor.email if obj.actor else None

    @staticmethod
    def resolve_user(obj):
        return obj.target_user.email if obj.target_user else None


@router.get(
    "/labs/{slug}/audit",
    response=list[AuditEventOut],
    summary="A lab's audit log (lab admins)",
    description=PAGED + " Oldest first, like every list: keep the time a run started and "
    "pass it as `updated_since` next time. This list has no `total`: it grows for as long "
    "as the lab lives.",
)
@paginate(KeysetPagination, with_total=False)
def audit_log(
    request,
    slug: str,
    action: str | None = Query(
        None, description="Only events of this kind, e.g. `membership.approved`."
    ),
    actor: str | None = Query(
        None,
        description="Only what this person did: their email or unix username (someone "
        "who is, was or acted in the lab).",
    ),
    user: str | None = Query(
        None, description="Only events about this person: their email or unix username."
    ),
    updated_since: str | None = Query(
        None, description="Only events at or after this ISO 8601 time."
    ),
):
    lab = access.get_admin_lab(request.user, slug)
    events = lab.audit_events.select_related("actor", "target_user")
    filters = Q()
    if kind := parse_choice(action, AuditAction, "action"):
        filters &= Q(action=kind)
    if (person := api_filters.lab_actor(lab, actor)) is not None:
        filters &= Q(actor=person)
    if (about := api_filters.lab_member(lab, user)) is not None:
        filters &= Q(target_user=about)
    if (since := parse_since(updated_since)) is not None:
        filters &= Q(created_at__gte=since)
    return events.filter(filters)


# --- Invites -------------------------------------------------------------------------


class InviteState(TextChoices):
    """Where an invite stands, worked out from its times."""

    OPEN = "open", "Works"
    USED = "used", "Used"
    REVOKED = "revoked", "Revoked"
    EXPIRED = "expired", "Expired"


def _invite_state(state: str) -> Q:
    unused = Q(used_at=None, revoked_at=None)
    now = timezone.now()
    return {
        InviteState.OPEN: unused & Q(expires_at__gt=now),
        InviteState.USED: Q(used_at__isnull=False),
        InviteState.REVOKED: Q(used_at=None, revoked_at__isnull=False),
        InviteState.EXPIRED: unused & Q(expires_at__lte=now),
    }[state]


class InviteOut(Schema):
    id: int
    # Only this address may use it; empty for a link anyone it is sent to can use once.
    email: str
    role: str
    # open (the link works), used, revoked or expired.
    state: str
    created_by: str | None
    created_at: datetime
    expires_at: datetime
    used_by: str | None
    used_at: datetime | None
    revoked_at: datetime | None

    @staticmethod
    def resolve_state(obj):
        if obj.used_at is not None:
            return InviteState.USED
        if obj.revoked_at is not None:
            return InviteState.REVOKED
        return InviteState.OPEN if obj.expires_at > timezone.now() else InviteState.EXPIRED

    @staticmethod
    def resolve_created_by(obj):
        return obj.created_by.email if obj.created_by else None

    @staticmethod
    def resolve_used_by(obj):
        return obj.used_by.email if obj.used_by else None


class NewInviteOut(InviteOut):
    # The link to send. It is in this answer only: the portal keeps just its hash.
    link: str


class InviteIn(StrictIn):
    # Only this address may use the link (it is emailed to it); empty for an open link.
    email: str = ""
    role: str = Role.MEMBER


@router.get(
    "/labs/{slug}/invites",
    response=list[InviteOut],
    summary="A lab's invites (lab admins)",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_invites(
    request,
    slug: str,
    state: str | None = Query(None, description=filter_help("state", InviteState)),
):
    lab = access.get_admin_lab(request.user, slug)
    invites = lab.invites.select_related("created_by", "used_by")
    if state := parse_choice(state, InviteState, "state"):
        invites = invites.filter(_invite_state(state))
    return invites


@router.post(
    "/labs/{slug}/invites",
    response={201: NewInviteOut, 400: FormError},
    summary="Make an invite link, shown once (lab admins)",
)
def create_invite(request, slug: str, payload: InviteIn):
    lab = access.get_admin_lab(request.user, slug)
    form = InviteForm(payload.dict())
    if not form.is_valid():
        return refused(form)
    try:
        invite, raw = lab_services.create_invite(
            request.user, lab, request=request, **form.cleaned_data
        )
    except LabError as exc:
        return refusal(str(exc))
    invite.link = request.build_absolute_uri(reverse("invite", args=[raw]))
    return Status(201, invite)


@router.post(
    "/labs/{slug}/invites/{invite_id}/revoke",
    response=InviteOut,
    summary="Make an invite link stop working (lab admins; a used one stays used)",
)
def revoke_invite(request, slug: str, invite_id: int):
    lab = access.get_admin_lab(request.user, slug)
    invite = access.get_invite_for_admin(request.user, lab, invite_id)
    lab_services.revoke_invite(request.user, invite, request=request)
    invite.refresh_from_db()
    return invite


# The TPU VMs page's actions, registered with this router.
router.add_router("", inventory_actions)

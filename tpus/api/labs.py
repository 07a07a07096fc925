"""API endpoints about labs and memberships. Lookups go through ``tpus.access``
exactly as the pages do."""

from __future__ import annotations

from datetime import date, datetime

from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, Subquery, Value
from ninja import Query, Router, Schema, Status
from ninja.pagination import paginate

from portal.pagination import KeysetPagination, parse_choice, parse_since
from portal.schemas import Error, MultilineText
from tpus import access
from tpus.api import filters as api_filters
from tpus.api.docs import PAGED, filter_help
from tpus.api.inventory import ZoneSyncOut
from tpus.models import Membership
from tpus.models.labs import MembershipState, Role
from tpus.services import labs as lab_services
from tpus.services import sync_health
from tpus.services.labs import PURPOSE_MAX, LabError

router = Router(tags=["labs"])


class LabOut(Schema):
    slug: str
    name: str
    # Null unless the caller is an approved member of the lab (or a site admin).
    gcp_project_id: str | None
    zones: list[str] | None
    grant_end_date: date | None
    default_sudo: bool
    policy_text: str
    policy_version: int
    my_state: str | None = None
    my_role: str | None = None
    # For the lab's admins: how listing each zone from the Cloud TPU API last went.
    sync: list[ZoneSyncOut] | None = None


class MembershipOut(Schema):
    id: int
    lab: str
    user: str
    role: str
    state: str
    purpose: str
    requested_at: datetime
    decided_at: datetime | None
    policy_version_accepted: int | None

    @staticmethod
    def resolve_lab(obj):
        return obj.lab.slug

    @staticmethod
    def resolve_user(obj):
        return obj.user.email


class JoinIn(Schema):
    purpose: MultilineText(PURPOSE_MAX, min_length=1)
    accept_policy: bool


class RejectIn(Schema):
    note: MultilineText(500) = ""


def _lab_out(lab, membership, *, show_project: bool, syncs=None) -> dict:
    out = LabOut.from_orm(lab).dict()
    if not show_project:
        out["gcp_project_id"] = out["zones"] = None
    if membership is not None:
        out["my_state"], out["my_role"] = membership.state, membership.role
    if syncs is not None:
        out["sync"] = [_zone_sync(row) for row in syncs]
    return out


def _zone_sync(row) -> dict:
    fields = ("zone", "failing_since", "last_success_at", "last_failure_at", "last_error")
    return {"failing": row.failing, **{name: getattr(row, name) for name in fields}}


def _syncs_shown(user, lab_ids) -> dict[int, list]:
    """Zone sync rows of the labs among ``lab_ids`` that ``user`` administers."""
    admin_ids = set(access.admin_labs(user).filter(pk__in=lab_ids).values_list("pk", flat=True))
    found = sync_health.by_lab(admin_ids)
    return {lab_id: found.get(lab_id, []) for lab_id in admin_ids}


class ListedLabOut(LabOut):
    @staticmethod
    def resolve_gcp_project_id(obj):
        return obj.gcp_project_id if obj.show_project else None

    @staticmethod
    def resolve_zones(obj):
        return obj.zones if obj.show_project else None

    @staticmethod
    def resolve_sync(obj):
        # Prefetched with the page; shown to the lab's admins only.
        if not obj.show_sync:
            return None
        return [_zone_sync(row) for row in obj.zone_syncs.all()]


@router.get(
    "/labs",
    response=list[ListedLabOut],
    summary="Labs I belong to or can ask to join",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_labs(request):
    user = request.user
    mine = Membership.objects.filter(lab=OuterRef("pk"), user=user)
    approved = mine.filter(state=MembershipState.APPROVED)
    # The caller's own standing in each lab, in the same query as the labs.
    return (
        access.visible_labs(user)
        .annotate(
            my_state=Subquery(mine.values("state")[:1]),
            my_role=Subquery(mine.values("role")[:1]),
            show_project=Value(True) if user.is_site_admin else Exists(approved),
            show_sync=Value(True)
            if user.is_site_admin
            else Exists(approved.filter(role=Role.ADMIN)),
        )
        .prefetch_related("zone_syncs")
    )


class LabCreateIn(Schema):
    name: str
    slug: str
    gcp_project_id: str
    zones: list[str] = []
    admin_emails: list[str]
    grant_end_date: date | None = None
    default_sudo: bool = False
    discoverable: bool = True
    policy_text: MultilineText(10000) | None = None


@router.post(
    "/labs",
    response={201: LabOut, 400: Error},
    summary="Open a lab with its GCP project and first admins (site admins)",
)
def create_lab(request, payload: LabCreateIn):
    if not request.user.is_site_admin:
        raise PermissionDenied("Only site admins can create labs.")
    fields = payload.dict()
    emails = fields.pop("admin_emails")
    if fields["policy_text"] is None:
        fields.pop("policy_text")
    try:
        lab = lab_services.create_lab(request.user, admin_emails=emails, request=request, **fields)
    except LabError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, _lab_out(lab, None, show_project=True, syncs=[]))


@router.get("/labs/{slug}", response=LabOut, summary="One lab")
def get_lab(request, slug: str):
    lab = access.get_visible_lab(request.user, slug)
    membership = request.user.memberships.filter(lab=lab).first()
    shown = lab.pk in access.project_visible_lab_ids(request.user)
    syncs = _syncs_shown(request.user, [lab.pk]).get(lab.pk)
    return _lab_out(lab, membership, show_project=shown, syncs=syncs)


@router.post(
    "/labs/{slug}/join",
    response={201: MembershipOut, 400: Error},
    summary="Ask to join a lab (accepting its policy)",
)
def join_lab(request, slug: str, payload: JoinIn):
    lab = access.get_visible_lab(request.user, slug)
    try:
        membership = lab_services.request_membership(
            request.user,
            lab,
            purpose=payload.purpose,
            accept_policy=payload.accept_policy,
            request=request,
        )
    except LabError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, membership)


@router.get(
    "/memberships", response=list[MembershipOut], summary="My memberships", description=PAGED
)
@paginate(KeysetPagination)
def my_memberships(
    request,
    state: str | None = Query(None, description=filter_help("state", MembershipState)),
):
    memberships = request.user.memberships.select_related("lab", "user")
    state = parse_choice(state, MembershipState, "state")
    return memberships.filter(state=state) if state else memberships


@router.get(
    "/labs/{slug}/memberships",
    response=list[MembershipOut],
    summary="A lab's memberships (lab admins)",
    description=PAGED,
)
@paginate(KeysetPagination)
def lab_memberships(
    request,
    slug: str,
    state: str | None = Query(None, description=filter_help("state", MembershipState)),
    role: str | None = Query(None, description=filter_help("role", Role)),
    user: str | None = Query(None, description=filter_help("user")),
    updated_since: str | None = Query(None, description=filter_help("updated_since")),
):
    lab = access.get_admin_lab(request.user, slug)
    memberships = lab.memberships.select_related("lab", "user")
    filters = Q()
    if state := parse_choice(state, MembershipState, "state"):
        filters &= Q(state=state)
    if role := parse_choice(role, Role, "role"):
        filters &= Q(role=role)
    if (person := api_filters.lab_member(lab, user)) is not None:
        filters &= Q(user=person)
    if (since := parse_since(updated_since)) is not None:
        filters &= Q(changed_at__gte=since)
    return memberships.filter(filters)


@router.post(
    "/labs/{slug}/memberships/{membership_id}/approve",
    response={200: MembershipOut, 400: Error},
    summary="Approve a request to join (lab admins)",
)
def approve(request, slug: str, membership_id: int):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    try:
        return lab_services.approve_membership(request.user, membership, request=request)
    except LabError as exc:
        return Status(400, {"detail": str(exc)})


@router.post(
    "/labs/{slug}/memberships/{membership_id}/reject",
    response={200: MembershipOut, 400: Error},
    summary="Reject a request to join (lab admins)",
)
def reject(request, slug: str, membership_id: int, payload: RejectIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    try:
        return lab_services.reject_membership(
            request.user, membership, note=payload.note, request=request
        )
    except LabError as exc:
        return Status(400, {"detail": str(exc)})

"""API endpoints about labs and memberships. Lookups go through ``tpus.access``
exactly as the pages do."""

from __future__ import annotations

from datetime import date, datetime

from ninja import Router, Schema, Status

from portal.schemas import Error, MultilineText
from tpus import access
from tpus.models.labs import MembershipState
from tpus.services import labs as lab_services
from tpus.services.labs import PURPOSE_MAX, LabError

router = Router(tags=["labs"])


class LabOut(Schema):
    slug: str
    name: str
    gcp_project_id: str
    zones: list[str]
    grant_end_date: date | None
    default_sudo: bool
    default_agent_forwarding: bool
    policy_text: str
    policy_version: int
    my_state: str | None = None
    my_role: str | None = None


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


def _lab_out(lab, membership) -> dict:
    out = LabOut.from_orm(lab).dict()
    if membership is not None:
        out["my_state"], out["my_role"] = membership.state, membership.role
    return out


@router.get("/labs", response=list[LabOut], summary="Labs I belong to or can ask to join")
def list_labs(request):
    mine = {m.lab_id: m for m in request.user.memberships.all()}
    return [_lab_out(lab, mine.get(lab.pk)) for lab in access.visible_labs(request.user)]


@router.get("/labs/{slug}", response=LabOut, summary="One lab")
def get_lab(request, slug: str):
    lab = access.get_visible_lab(request.user, slug)
    return _lab_out(lab, request.user.memberships.filter(lab=lab).first())


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


@router.get("/memberships", response=list[MembershipOut], summary="My memberships")
def my_memberships(request):
    return request.user.memberships.select_related("lab", "user")


@router.get(
    "/labs/{slug}/memberships",
    response=list[MembershipOut],
    summary="A lab's memberships (lab admins)",
)
def lab_memberships(request, slug: str, state: MembershipState | None = None):
    lab = access.get_admin_lab(request.user, slug)
    memberships = lab.memberships.select_related("lab", "user")
    return memberships.filter(state=state) if state else memberships


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

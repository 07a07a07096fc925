"""API endpoints for kind grants (lab admins): every TPU VM of an accelerator type in
the lab, to one member, now and later."""

from __future__ import annotations

from datetime import date, datetime

from ninja import Router, Schema, Status
from ninja.pagination import paginate
from pydantic import BaseModel, model_validator

from portal.pagination import KeysetPagination
from portal.schemas import Error
from tpus import access
from tpus.api.docs import PAGED
from tpus.models import KindGrant
from tpus.services import kind_grants as kind_services
from tpus.services.grants import GrantError

router = Router(tags=["access"])


class KindGrantOut(BaseModel):
    """A kind grant: the person may use every VM of ``accelerator_type`` in ``lab``.
    ``vms`` is how many VMs it holds access on now (its grants there are in the lab's
    grants list with ``from_kind`` set to the type)."""

    id: int
    lab: str
    user: str
    username: str | None
    accelerator_type: str
    sudo: bool
    expires_on: date | None
    state: str
    vms: int
    created_at: datetime
    revoked_at: datetime | None

    @model_validator(mode="before")
    @classmethod
    def _from_row(cls, obj):
        if not isinstance(obj, KindGrant):
            return obj
        account = getattr(obj.user, "unix_account", None)
        return {
            "id": obj.pk,
            "lab": obj.lab.slug,
            "user": obj.user.email,
            "username": account.username if account else None,
            "accelerator_type": obj.accelerator_type,
            "sudo": obj.sudo,
            "expires_on": obj.expires_on,
            "state": obj.state,
            # Counted by the list; a kind grant just made or revoked counts its own.
            "vms": obj.vms if hasattr(obj, "vms") else kind_services.vms_held(obj),
            "created_at": obj.created_at,
            "revoked_at": obj.revoked_at,
        }


class KindGrantIn(Schema):
    user_email: str
    accelerator_type: str
    sudo: bool = False
    expires_on: date | None = None


@router.get(
    "/labs/{slug}/kind-grants",
    response=list[KindGrantOut],
    summary="A lab's kind grants (lab admins)",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_kind_grants(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return kind_services.kind_grants_of(lab).select_related("lab")


@router.post(
    "/labs/{slug}/kind-grants",
    response={201: KindGrantOut, 400: Error},
    summary="Give a member every TPU VM of an accelerator type, now and later (lab admins)",
)
def create_kind_grant(request, slug: str, payload: KindGrantIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = (
        lab.memberships.select_related("user")
        .filter(user__email__iexact=payload.user_email.strip())
        .first()
    )
    if membership is None:
        return Status(400, {"detail": f"{payload.user_email} is not a member of {lab.name}."})
    try:
        kind = kind_services.grant_kind(
            request.user,
            lab,
            membership.user,
            payload.accelerator_type,
            sudo=payload.sudo,
            expires_on=payload.expires_on,
            request=request,
        )
    except GrantError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, kind)


@router.post(
    "/labs/{slug}/kind-grants/{kind_grant_id}/revoke",
    response=KindGrantOut,
    summary="Revoke a kind grant and the access it gave (lab admins)",
)
def revoke_kind_grant(request, slug: str, kind_grant_id: int):
    lab = access.get_admin_lab(request.user, slug)
    kind = access.get_kind_grant_for_admin(request.user, lab, kind_grant_id)
    return kind_services.revoke_kind_grant(request.user, kind, request=request)

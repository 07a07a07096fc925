"""API endpoints about access: grants (lab admins), the caller's own TPU VMs, their
ssh config and known_hosts, and a VM's IP history."""

from __future__ import annotations

from datetime import date, datetime

from django.http import HttpResponse
from ninja import Router, Schema, Status

from portal.schemas import Error
from tpus import access
from tpus.models import IpChange
from tpus.services import grants as grant_services
from tpus.services import sshconfig
from tpus.services.grants import GrantError

router = Router(tags=["access"])


class GrantOut(Schema):
    id: int
    vm: str
    vm_id: int
    user: str
    username: str | None
    sudo: bool
    expires_on: date | None
    state: str
    error: str
    activated_at: datetime | None

    @staticmethod
    def resolve_vm(obj):
        return obj.vm.name

    @staticmethod
    def resolve_user(obj):
        return obj.user.email

    @staticmethod
    def resolve_username(obj):
        account = getattr(obj.user, "unix_account", None)
        return account.username if account else None


class GrantIn(Schema):
    user_email: str
    vm_ids: list[int]
    sudo: bool = False
    expires_on: date | None = None


class IpChangeOut(Schema):
    worker: str
    old_ip: str | None
    new_ip: str
    seen_at: datetime

    @staticmethod
    def resolve_worker(obj):
        return obj.worker.alias


@router.get("/labs/{slug}/grants", response=list[GrantOut], summary="A lab's grants")
def list_grants(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    from tpus.models import Grant

    return Grant.objects.filter(vm__lab=lab).select_related("vm", "user__unix_account")


@router.post(
    "/labs/{slug}/grants",
    response={201: list[GrantOut], 400: Error},
    summary="Give a member access to TPU VMs (lab admins)",
)
def create_grants(request, slug: str, payload: GrantIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = (
        lab.memberships.select_related("user")
        .filter(user__email__iexact=payload.user_email.strip())
        .first()
    )
    if membership is None or len(payload.vm_ids) > 100:
        return Status(400, {"detail": f"{payload.user_email} is not a member of {lab.name}."})
    vms = [access.get_vm_for_admin(request.user, lab, vm_id) for vm_id in payload.vm_ids]
    try:
        grants = grant_services.grant_access(
            request.user,
            lab,
            membership.user,
            vms,
            sudo=payload.sudo,
            expires_on=payload.expires_on,
            request=request,
        )
    except GrantError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, grants)


@router.post("/labs/{slug}/grants/{grant_id}/revoke", response=GrantOut, summary="Revoke a grant")
def revoke_grant(request, slug: str, grant_id: int):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    return grant_services.revoke_access(request.user, grant, request=request)


@router.get("/me/grants", response=list[GrantOut], summary="My access to TPU VMs")
def my_grants(request):
    return request.user.grants.select_related("vm", "user__unix_account")


@router.get("/me/ssh-config", summary="My ssh config (text)")
def my_ssh_config(request):
    return HttpResponse(sshconfig.render_config(request.user), content_type="text/plain")


@router.get("/me/known-hosts", summary="The pinned host keys for my ssh config (text)")
def my_known_hosts(request):
    body = sshconfig.render_known_hosts(sshconfig.vms_for(request.user))
    return HttpResponse(body, content_type="text/plain")


@router.get(
    "/labs/{slug}/vms/{vm_id}/ip-history",
    response=list[IpChangeOut],
    summary="External IP changes of a VM's workers",
)
def ip_history(request, slug: str, vm_id: int):
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    return IpChange.objects.filter(worker__vm=vm).select_related("worker__vm")[:500]

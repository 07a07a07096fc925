"""Who may see what. Every view and API endpoint finds its objects through these
helpers, so tenancy is enforced in one place: an object of a lab the person does not
belong to is a 404, indistinguishable from one that does not exist."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import Http404

from tpus.models import Invite, Lab, Membership
from tpus.models.labs import MembershipState, Role


def member_labs(user) -> QuerySet[Lab]:
    """Labs whose members' area this person may see: approved memberships; every lab
    for a site admin."""
    if not user.is_authenticated:
        return Lab.objects.none()
    if user.is_site_admin:
        return Lab.objects.all()
    return Lab.objects.filter(
        Exists(
            Membership.objects.filter(lab=OuterRef("pk"), user=user, state=MembershipState.APPROVED)
        )
    )


def admin_labs(user) -> QuerySet[Lab]:
    """Labs this person administers (all of them for a site admin)."""
    if not user.is_authenticated:
        return Lab.objects.none()
    if user.is_site_admin:
        return Lab.objects.all()
    return Lab.objects.filter(
        Exists(
            Membership.objects.filter(
                lab=OuterRef("pk"),
                user=user,
                state=MembershipState.APPROVED,
                role=Role.ADMIN,
            )
        )
    )


def visible_labs(user) -> QuerySet[Lab]:
    """Labs this person may know exist: their own (in any state) and discoverable
    ones they could ask to join."""
    if not user.is_authenticated:
        return Lab.objects.none()
    if user.is_site_admin:
        return Lab.objects.all()
    mine = Membership.objects.filter(lab=OuterRef("pk"), user=user)
    return Lab.objects.filter(Q(discoverable=True) | Q(Exists(mine)))


def get_visible_lab(user, slug: str) -> Lab:
    """A lab the person may ask to join or see their request for; else 404."""
    try:
        return visible_labs(user).get(slug=slug)
    except Lab.DoesNotExist:
        raise Http404("No such lab.") from None


def get_member_lab(user, slug: str) -> Lab:
    """A lab whose members' area the person may see; else 404."""
    try:
        return member_labs(user).get(slug=slug)
    except Lab.DoesNotExist:
        raise Http404("No such lab.") from None


def get_admin_lab(user, slug: str) -> Lab:
    """A lab the person administers. A member of that lab who is not an admin gets a
    403 (they already know it exists); anyone else a 404."""
    lab = get_member_lab(user, slug)
    if not admin_labs(user).filter(pk=lab.pk).exists():
        raise PermissionDenied("Only the lab's admins can do that.")
    return lab


def get_membership_for_admin(user, lab: Lab, membership_id: int) -> Membership:
    """A membership of a lab the person administers, looked up inside that lab."""
    try:
        return lab.memberships.select_related("user").get(pk=membership_id)
    except (Membership.DoesNotExist, ValueError, TypeError):
        raise Http404("No such membership.") from None


def get_invite_for_admin(user, lab: Lab, invite_id: int) -> Invite:
    try:
        return lab.invites.get(pk=invite_id)
    except (Invite.DoesNotExist, ValueError, TypeError):
        raise Http404("No such invite.") from None


def is_lab_admin(user, lab: Lab) -> bool:
    return admin_labs(user).filter(pk=lab.pk).exists()


def administers_any_lab(user) -> bool:
    if not user.is_authenticated:
        return False
    return Membership.objects.filter(
        user=user, state=MembershipState.APPROVED, role=Role.ADMIN
    ).exists()


def get_vm_for_admin(user, lab: Lab, vm_id: int):
    """A TPU VM of a lab the person administers, looked up inside that lab."""
    from tpus.models import TpuVm

    try:
        return lab.vms.get(pk=vm_id)
    except (TpuVm.DoesNotExist, ValueError, TypeError):
        raise Http404("No such TPU VM.") from None


def get_disk_for_admin(user, lab: Lab, disk_id: int):
    from tpus.models import DataDisk

    try:
        return lab.disks.get(pk=disk_id)
    except (DataDisk.DoesNotExist, ValueError, TypeError):
        raise Http404("No such disk.") from None


def get_worker_for_admin(user, lab: Lab, vm_id: int, index: int):
    from tpus.models import Worker

    try:
        return Worker.objects.select_related("vm").get(vm__lab=lab, vm_id=vm_id, index=index)
    except (Worker.DoesNotExist, ValueError, TypeError):
        raise Http404("No such worker.") from None


def get_grant_for_admin(user, lab: Lab, grant_id: int):
    from tpus.models import Grant

    try:
        return Grant.objects.select_related("vm", "user").get(pk=grant_id, vm__lab=lab)
    except (Grant.DoesNotExist, ValueError, TypeError):
        raise Http404("No such grant.") from None


def get_vm_for_viewer(user, lab: Lab, vm_id: int):
    """A VM the person may see: any VM of a lab they administer, or one they hold a
    grant on (in any state but revoked). Else 404."""
    from tpus.models import TpuVm
    from tpus.models.grants import GrantState

    vms = lab.vms.all()
    if not is_lab_admin(user, lab):
        vms = vms.filter(grants__user=user).exclude(grants__state=GrantState.REVOKED).distinct()
    try:
        return vms.get(pk=vm_id)
    except (TpuVm.DoesNotExist, ValueError, TypeError):
        raise Http404("No such TPU VM.") from None

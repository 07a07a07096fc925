"""Who may see what. Every view and API endpoint finds its objects through these
helpers, so tenancy is enforced in one place: an object of a lab the person does not
belong to is a 404, indistinguishable from one that does not exist."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, Q, QuerySet, Value
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


def project_visible_lab_ids(user) -> set[int]:
    """Labs whose GCP project id and zones this person may read: their approved
    memberships (every lab for a site admin). Someone who can only find a lab to ask
    to join it does not learn where its TPU VMs live."""
    return set(member_labs(user).values_list("pk", flat=True))


def get_visible_lab(user, slug: str) -> Lab:
    """A lab the person may ask to join or see their request for; else 404."""
    try:
        return visible_labs(user).get(slug=slug)
    except Lab.DoesNotExist:
        raise Http404("No such lab.") from None


def _admin_of(user):
    """True in a ``Lab`` query for the labs ``user`` administers (see ``admin_labs``)."""
    if user.is_site_admin:
        return Value(True)
    return Exists(
        Membership.objects.filter(
            lab=OuterRef("pk"), user=user, state=MembershipState.APPROVED, role=Role.ADMIN
        )
    )


def get_member_lab(user, slug: str) -> Lab:
    """A lab whose members' area the person may see; else 404. It carries whether
    they administer it (``is_lab_admin`` reads that instead of asking again)."""
    if not user.is_authenticated:
        raise Http404("No such lab.")
    try:
        lab = member_labs(user).annotate(viewer_is_admin=_admin_of(user)).get(slug=slug)
    except Lab.DoesNotExist:
        raise Http404("No such lab.") from None
    lab.viewer_of = user.pk
    return lab


def get_admin_lab(user, slug: str) -> Lab:
    """A lab the person administers. A member of that lab who is not an admin gets a
    403 (they already know it exists); anyone else a 404."""
    lab = get_member_lab(user, slug)
    if not is_lab_admin(user, lab):
        raise PermissionDenied("Only the lab's admins can do that.")
    return lab


def get_lab_for_site_admin(user, slug: str, reason: str) -> Lab:
    """A lab, for something only a site admin does. Like ``get_admin_lab`` (404 for
    a lab the person is not in), and a 403 with ``reason`` for the lab's own admins
    and members."""
    lab = get_admin_lab(user, slug)
    if not user.is_site_admin:
        raise PermissionDenied(reason)
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
    if getattr(lab, "viewer_of", None) == user.pk:
        return lab.viewer_is_admin  # read with the lab itself (``get_member_lab``)
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


def get_kind_grant_for_admin(user, lab: Lab, kind_grant_id: int):
    from tpus.models import KindGrant

    try:
        return KindGrant.objects.select_related("user").get(pk=kind_grant_id, lab=lab)
    except (KindGrant.DoesNotExist, ValueError, TypeError):
        raise Http404("No such kind grant.") from None


def viewable_vms(user, lab: Lab, *, is_admin: bool | None = None) -> QuerySet:
    """The lab's VMs the person may see: every one for its admins, else those they
    hold a grant on (in any state but revoked)."""
    from tpus.models import Grant
    from tpus.models.grants import GrantState

    vms = lab.vms.all()
    if not (is_lab_admin(user, lab) if is_admin is None else is_admin):
        # One subquery about this person's own grant: filter(grants__user=...) followed
        # by exclude(grants__state=...) would drop the VM when anyone else's grant on it
        # is revoked (exclude on a multi-valued relation matches any related row).
        mine = Grant.objects.filter(vm=OuterRef("pk"), user=user).exclude(state=GrantState.REVOKED)
        vms = vms.filter(Exists(mine))
    return vms


def get_vm_for_viewer(user, lab: Lab, vm_id: int, *, is_admin: bool | None = None):
    """A VM the person may see (``viewable_vms``). Else 404."""
    from tpus.models import TpuVm

    try:
        return viewable_vms(user, lab, is_admin=is_admin).get(pk=vm_id)
    except (TpuVm.DoesNotExist, ValueError, TypeError):
        raise Http404("No such TPU VM.") from None


def get_vm_for_grantee(user, vm_id: int):
    """A VM the person holds a wanted grant on (the VMs in their ssh config), whatever
    their role in its lab: their own port forwards and the like. Else 404."""
    from tpus.models import Grant, TpuVm
    from tpus.models.grants import WANTED_STATES

    mine = Grant.objects.filter(vm=OuterRef("pk"), user=user, state__in=WANTED_STATES)
    try:
        return TpuVm.objects.select_related("lab").filter(Exists(mine)).get(pk=vm_id)
    except (TpuVm.DoesNotExist, ValueError, TypeError):
        raise Http404("No such TPU VM.") from None


def get_job_for_viewer(user, lab: Lab, vm_id: int, job_id: int):
    """A job whose page, environment and logs the person may see: their own, or any
    job of a lab they administer, on a VM they may see. Anyone else gets a 404: people
    who share the VM see its queue (who, what, in which state) on the VM's page, not
    the job's own page."""
    from tpus.models import Job

    is_admin = is_lab_admin(user, lab)
    vm = get_vm_for_viewer(user, lab, vm_id, is_admin=is_admin)
    jobs = Job.objects.filter(vm=vm).select_related("vm__lab", "user__unix_account", "snapshot")
    if not is_admin:
        jobs = jobs.filter(user=user)
    try:
        return jobs.get(pk=job_id)
    except (Job.DoesNotExist, ValueError, TypeError):
        raise Http404("No such job.") from None


def get_lab_job_for_viewer(user, lab: Lab, job_id: int):
    """A job of the lab found by its id alone, with the checks of
    ``get_job_for_viewer``: a job placed on a VM (or named for one) as its VM's path
    answers it; a job still waiting for a VM of its kind for the person who submitted
    it and the lab's admins. Anyone else, and another lab's job, gets a 404."""
    from tpus.models import Job

    try:
        job = Job.objects.select_related("lab", "user__unix_account", "snapshot").get(
            Q(lab=lab) | Q(vm__lab=lab), pk=job_id
        )
    except (Job.DoesNotExist, ValueError, TypeError):
        raise Http404("No such job.") from None
    if job.vm_id is not None:
        return get_job_for_viewer(user, lab, job.vm_id, job.pk)
    if job.user_id != user.pk and not is_lab_admin(user, lab):
        raise Http404("No such job.")
    return job


def get_own_job(user, job_id: int):
    """A job the person submitted, found by its id alone, with the checks of
    ``get_job_for_viewer``: in a lab whose members' area they may see, on a VM they may
    see. Another person's job, and a job in a lab they are not (or no longer) in, is a
    404, whoever administers what."""
    from tpus.models import Job

    # Read once, with all its object shows (followed by a client every few tenths of
    # a second while it starts): the person's own job needs no more than the lab's
    # membership and, on a VM, that they may still see the VM.
    jobs = Job.objects.select_related("vm__lab", "lab", "user__unix_account", "snapshot")
    try:
        job = jobs.get(pk=job_id, user=user)
    except (Job.DoesNotExist, ValueError, TypeError):
        raise Http404("No such job.") from None
    lab = get_member_lab(user, (job.vm.lab if job.vm_id else job.lab).slug)
    if job.vm_id is not None and not viewable_vms(user, lab).filter(pk=job.vm_id).exists():
        raise Http404("No such job.")
    return job


CANCEL_REFUSED = "Only the person who submitted a job and the lab's admins can cancel it."


def may_cancel_job(user, job) -> bool:
    """The person who submitted a job and the lab's admins may cancel it."""
    return job.user_id == user.pk or is_lab_admin(user, job.vm.lab if job.vm_id else job.lab)

"""Who the lab's policy on idle chips leaves alone: people (``Membership.idle_exempt``)
and TPU VMs (``TpuVm.idle_exempt``), set by the lab's admins with the lab's settings
(``labs.update_lab``) and read by the pass (``idle_holders``)."""

from __future__ import annotations

from portal import audit
from portal.audit import AuditAction
from tpus.models import Lab, Membership, TpuVm


def set_exemptions(admin, lab: Lab, people, vms, *, request=None) -> bool:
    """Exempt exactly these memberships and VMs of ``lab`` from the policy; audited
    when anything changed. True when it did."""
    people, vms = list(people), list(vms)
    people_ids = {m.pk for m in people}
    vm_ids = {v.pk for v in vms}
    before_people = set(
        Membership.objects.filter(lab=lab, idle_exempt=True).values_list("pk", flat=True)
    )
    before_vms = set(TpuVm.objects.filter(lab=lab, idle_exempt=True).values_list("pk", flat=True))
    if before_people == people_ids and before_vms == vm_ids:
        return False
    Membership.objects.filter(lab=lab).exclude(pk__in=people_ids).update(idle_exempt=False)
    Membership.objects.filter(lab=lab, pk__in=people_ids).update(idle_exempt=True)
    TpuVm.objects.filter(lab=lab).exclude(pk__in=vm_ids).update(idle_exempt=False)
    TpuVm.objects.filter(lab=lab, pk__in=vm_ids).update(idle_exempt=True)
    audit.record(
        AuditAction.IDLE_EXEMPTIONS_SET,
        actor=admin,
        lab=lab,
        summary=f"{len(people_ids)} people, {len(vm_ids)} VMs exempt",
        data={
            "people": sorted(
                m.user.email
                for m in Membership.objects.filter(pk__in=people_ids).select_related("user")
            ),
            "vms": sorted(v.name for v in vms),
        },
        request=request,
    )
    return True


def exempt_objects(lab: Lab) -> tuple[list[Membership], list[TpuVm]]:
    """The memberships and VMs of ``lab`` exempt from the policy now."""
    return (
        list(Membership.objects.filter(lab=lab, idle_exempt=True).select_related("user")),
        list(TpuVm.objects.filter(lab=lab, idle_exempt=True)),
    )


def exemptions(lab: Lab) -> dict[str, list[str]]:
    """The exempt people (emails) and VMs (names) of ``lab``, for the API."""
    return {
        "idle_exempt_people": sorted(
            Membership.objects.filter(lab=lab, idle_exempt=True).values_list(
                "user__email", flat=True
            )
        ),
        "idle_exempt_vms": sorted(
            TpuVm.objects.filter(lab=lab, idle_exempt=True).values_list("name", flat=True)
        ),
    }

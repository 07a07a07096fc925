"""Access to every TPU VM of a kind: "milo may use any v4-8 of the lab".

A kind grant is a row (``KindGrant``) that holds an ordinary grant on each VM of its
accelerator type in the lab, made through ``grants.grant_access`` so that the reconcile,
the emails and the audit log behave as for a grant given by hand. Those grants record
where they came from (``Grant.from_kind``): revoking the kind grant revokes exactly
them, never a grant an admin gave on one of those VMs by hand.

A VM of the kind that joins the lab later (imported, made by a request, registered by
hand) or becomes grantable (its workers' host keys pinned, its node made anew) gets
the kind's grants from ``apply_kind_grants``, the one function every such place calls.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.models import AuditAction, Grant, KindGrant, Lab, TpuVm
from tpus.models.grants import WANTED_STATES, GrantState, KindGrantState
from tpus.models.inventory import validate_accelerator_type
from tpus.models.provisioning import VmRequest, chips_of
from tpus.services import grants
from tpus.services.grants import GrantError

log = logging.getLogger(__name__)


def lab_kinds(lab: Lab) -> list[str]:
    """The accelerator types the lab has: those of its VMs, of its VM requests and of
    its kind grants, sorted."""
    found = set(lab.vms.exclude(accelerator_type="").values_list("accelerator_type", flat=True))
    found |= set(VmRequest.objects.filter(lab=lab).values_list("accelerator_type", flat=True))
    found |= set(lab.kind_grants.values_list("accelerator_type", flat=True))
    return sorted(found, key=lambda kind: (chips_of(kind)[0], chips_of(kind)[1], kind))


def check_kind(lab: Lab, accelerator_type: str) -> None:
    """Refuse a type that is not a TPU type, or that the lab neither has nor may make
    (no VM or request of it, no allowance for its generation)."""
    if not validate_accelerator_type.regex.search(accelerator_type or ""):
        raise GrantError(
            f"“{accelerator_type}” is not an accelerator type; one looks like v4-8 or v5litepod-8."
        )
    if accelerator_type in lab_kinds(lab):
        return
    generation, _ = chips_of(accelerator_type)
    if not lab.allowances.filter(generation=generation).exists():
        raise GrantError(
            f"{lab.name} has no {accelerator_type} and no allowance for {generation} chips."
        )


def _grantable_vms(lab: Lab, accelerator_type: str) -> list[TpuVm]:
    """The lab's VMs of the type that can take a grant now: every worker's host keys
    pinned (the others get the kind's grants once they are). Their workers are read in
    the same go, so the checks of ``grant_access`` cost no query per VM."""
    vms = TpuVm.objects.filter(lab=lab, accelerator_type=accelerator_type).prefetch_related(
        "workers"
    )
    return [
        vm
        for vm in vms.order_by("name", "pk")
        if vm.workers.all() and all(w.is_pinned for w in vm.workers.all())
    ]


def grant_kind(
    admin,
    lab: Lab,
    user,
    accelerator_type: str,
    *,
    sudo: bool,
    expires_on: dt.date | None = None,
    request=None,
) -> KindGrant:
    """Give ``user`` access to every VM of ``accelerator_type`` in ``lab``, now and
    later. Granting it again with other options changes them on every VM it holds;
    granting a revoked one again reuses it. Refused (``GrantError``, nothing stored)
    for whoever could not be given a VM grant, or a type the lab does not have."""
    accelerator_type = (accelerator_type or "").strip()
    grants.check_person(lab, user, expires_on)
    check_kind(lab, accelerator_type)
    with transaction.atomic():
        kind, created = KindGrant.objects.select_for_update().get_or_create(
            lab=lab,
            user=user,
            accelerator_type=accelerator_type,
            defaults={"sudo": sudo, "expires_on": expires_on, "created_by": admin},
        )
        now = timezone.now()
        changed = created or (kind.state, kind.sudo, kind.expires_on) != (
            KindGrantState.ACTIVE,
            sudo,
            expires_on,
        )
        kind.sudo, kind.expires_on, kind.state = sudo, expires_on, KindGrantState.ACTIVE
        kind.granted_at = now
        kind.revoked_at = kind.revoked_by = None
        if changed:
            kind.changed_at = now
        kind.save()
        if changed:
            audit.record(
                AuditAction.KIND_GRANT_CREATED,
                actor=admin,
                lab=lab,
                target_user=user,
                summary=f"every {accelerator_type}{' with sudo' if sudo else ''}"
                + (f" until {expires_on:%Y-%m-%d}" if expires_on else ""),
                data={"kind_grant": kind.pk, "accelerator_type": accelerator_type, "sudo": sudo},
                request=request,
            )
        vms = _grantable_vms(lab, accelerator_type)
        if vms:
            grants.grant_access(
                admin,
                lab,
                user,
                vms,
                sudo=sudo,
                expires_on=expires_on,
                from_kind=kind,
                request=request,
            )
    return kind


def revoke_kind_grant(actor, kind: KindGrant, *, request=None) -> KindGrant:
    """End a kind grant and revoke the VM grants it made; a grant given by hand on a VM
    of the kind stays. Revoking a revoked kind grant changes nothing."""
    grants.end_kind_grants(actor, KindGrant.objects.filter(pk=kind.pk), reason="", request=request)
    reason = f"the {kind.accelerator_type} grant was revoked"
    for grant in kind.grants.filter(state__in=WANTED_STATES).select_related("vm"):
        grants.revoke_access(actor, grant, reason=reason, request=request)
    kind.refresh_from_db()
    return kind


def apply_kind_grants(vm: TpuVm) -> list[Grant]:
    """Give ``vm`` the grants of its lab's active kind grants on its accelerator type.
    Called wherever a VM joins the lab or becomes grantable; nothing happens until
    every worker's host keys are pinned. A person who holds a grant there already
    keeps it as it is, and one whose grant there was revoked since the kind was last
    granted is not given it back. A person who can no longer be given access (their
    policy, the lab's end date) is left out, and logged."""
    if not vm.accelerator_type:
        return []
    kinds = list(
        KindGrant.objects.filter(
            lab_id=vm.lab_id, accelerator_type=vm.accelerator_type, state=KindGrantState.ACTIVE
        ).select_related("lab", "user")
    )
    if not kinds:
        return []
    workers = list(vm.workers.all())
    if not workers or not all(w.is_pinned for w in workers):
        return []
    held = {
        user_id: (state, changed_at)
        for user_id, state, changed_at in Grant.objects.filter(
            vm=vm, user__in=[kind.user_id for kind in kinds]
        ).values_list("user_id", "state", "changed_at")
    }
    ended = (GrantState.REVOKING, GrantState.REVOKED)
    made = []
    # One reconcile of the VM for everyone given it.
    with transaction.atomic(), queue.reconciles_gathered():
        for kind in kinds:
            state, changed_at = held.get(kind.user_id, (None, None))
            if state in WANTED_STATES or (state in ended and changed_at >= kind.granted_at):
                continue
            try:
                made += grants.grant_access(
                    None,
                    kind.lab,
                    kind.user,
                    [vm],
                    sudo=kind.sudo,
                    expires_on=kind.expires_on,
                    from_kind=kind,
                )
            except GrantError as exc:  # refused before it changed anything
                log.warning("%s not given to %s: %s", kind, vm, exc)
    return made


def kind_grants_of(lab: Lab):
    """The lab's kind grants, active first, each with ``vms``: how many VM grants it
    holds now (wanted ones)."""
    return (
        lab.kind_grants.select_related("user__unix_account")
        .annotate(vms=Count("grants", filter=Q(grants__state__in=WANTED_STATES)))
        .order_by("state", "accelerator_type", "user__email", "pk")
    )


def vms_held(kind: KindGrant) -> int:
    """How many VMs ``kind`` holds access on now."""
    return kind.grants.filter(state__in=WANTED_STATES).count()

"""What a lab may hold at once, as its TPU grant says: chips per generation and kind
(on-demand, spot, preemptible) until the grant's end date. A site admin sets both; every
way a lab comes to hold chips (a request, a stopped VM started again, a VM kept alive
asked for again after a preemption) is checked against them here, with the numbers.

A stopped VM holds none of the allowance (it holds no TPU chips at Google while
stopped), so a lab may stop a VM to make room for another; starting it again is checked
like a new request. Each of those checks runs with the lab's row locked, in the
transaction that makes the lab hold the chips (``claim``): two at once for one lab run
one after the other, and the second counts what the first made."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Lab, TpuVm
from tpus.models.inventory import NodeState
from tpus.models.provisioning import (
    OPEN_REQUEST_STATES,
    LabAllowance,
    LabNotice,
    Provisioning,
    VmRequest,
    chips_of,
)
from tpus.services import emails

# Node states in which a VM holds none of the lab's allowance.
NOT_HOLDING = {NodeState.PREEMPTED, NodeState.TERMINATED, NodeState.STOPPED}


def holding(lab: Lab, generation: str, provisioning: str) -> int:
    """Chips of a generation and kind the lab holds or has asked for now: its VMs that
    are up (or coming up) and its open requests."""
    spot_like = provisioning != Provisioning.ON_DEMAND
    used = 0
    for accelerator_type, preemptible in (
        TpuVm.objects.filter(lab=lab, missing_since__isnull=True)
        .exclude(state__in=NOT_HOLDING)
        .exclude(requests__state__in=OPEN_REQUEST_STATES)  # counted as a request below
        .values_list("accelerator_type", "preemptible")
    ):
        kind_matches = preemptible if spot_like else not preemptible
        found, chips = chips_of(accelerator_type)
        if found == generation and kind_matches:
            used += chips
    for accelerator_type in VmRequest.objects.filter(
        lab=lab, provisioning=provisioning, state__in=OPEN_REQUEST_STATES
    ).values_list("accelerator_type", flat=True):
        found, chips = chips_of(accelerator_type)
        if found == generation:
            used += chips
    return used


def grant_ended(lab: Lab) -> bool:
    return bool(lab.grant_end_date and timezone.localdate() > lab.grant_end_date)


def check_grant_open(lab: Lab) -> None:
    """ValidationError once the lab's TPU grant has ended: nothing can be made or
    started for it after that day."""
    if grant_ended(lab):
        raise ValidationError(
            f"The lab's TPU grant ended on {lab.grant_end_date:%-d %B %Y}; no VM can be made "
            "or started. A site admin moves the date when the grant is extended."
        )


def check_allowance(lab: Lab, accelerator_type: str, provisioning: str) -> None:
    """ValidationError with the numbers when one more VM of this type and kind would
    take the lab past its allowance (or past its grant's end)."""
    check_grant_open(lab)
    generation, _ = chips_of(accelerator_type)
    allowance = LabAllowance.objects.filter(
        lab=lab, generation=generation, provisioning=provisioning
    ).first()
    if allowance is None:
        _check_room(accelerator_type, provisioning, None, 0)  # refused: no allowance
    else:
        used = holding(lab, generation, provisioning)
        _check_room(accelerator_type, provisioning, allowance.chips, used)


def _check_room(accelerator_type: str, provisioning: str, allowance: int | None, used: int) -> None:
    """``check_allowance``'s refusal, from the allowance's chips (None: none) and the
    chips the lab holds of its generation and kind."""
    generation, chips = chips_of(accelerator_type)
    kind = Provisioning(provisioning).label.lower()
    if allowance is None:
        raise ValidationError(
            f"The lab has no allowance for {kind} {generation} chips; a site admin sets the "
            "lab's allowance from its TPU grant."
        )
    if used + chips > allowance:
        raise ValidationError(
            f"A {accelerator_type} is {chips} {generation} chips; the lab holds {used} {kind} "
            f"{generation} chips of its {allowance}, so {allowance - used} are left."
        )


@dataclass(frozen=True)
class Standing:
    """What a claim counts, as its caller read it in the claim's transaction after
    locking the lab's row there: the locked lab, the allowance's chips (None: none)
    and the chips the lab holds of the generation and kind (``holding``), with what
    the caller made since."""

    lab: Lab
    allowance: int | None
    used: int


def claim(
    lab: Lab,
    accelerator_type: str,
    provisioning: str,
    *,
    grant_only: bool = False,
    standing: Standing | None = None,
) -> Lab:
    """``check_allowance`` inside the transaction that makes the lab hold the chips (a
    request stored, a VM's state moved to starting, a kept-alive VM asked for again),
    with the lab's row locked first: concurrent claims of one lab wait for each other,
    and each counts what the ones before it made. The grant's end date is read as it is
    now. ``grant_only`` checks the grant's end alone (a VM the lab made itself, of a
    generation and kind it has no allowance for). With ``standing``, the caller locked
    the lab's row in this transaction and read the figures since: they are counted as
    they are, neither read nor locked again. Returns the locked lab. (SQLite takes its
    write lock when the transaction begins, which serialises them the same way.)"""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("claim() must run inside the transaction that takes the chips")
    if standing is not None:
        check_grant_open(standing.lab)
        _check_room(accelerator_type, provisioning, standing.allowance, standing.used)
        return standing.lab
    locked = Lab.objects.select_for_update().get(pk=lab.pk)
    if grant_only:
        check_grant_open(locked)
    else:
        check_allowance(locked, accelerator_type, provisioning)
    return locked


@dataclass(frozen=True)
class AllowanceUse:
    """One allowance, the chips the lab holds against it now, and the day it ends (the
    lab's TPU grant's end) with the days left counted from ``today``: 0 on its last
    day, below 0 once it has ended."""

    generation: str
    provisioning: str
    chips: int
    used: int
    ends_on: dt.date | None = None
    days_left: int | None = None

    @property
    def left(self) -> int:
        return max(0, self.chips - self.used)

    @property
    def ended(self) -> bool:
        return self.days_left is not None and self.days_left < 0


def allowance_use(lab: Lab, today: dt.date | None = None) -> list[AllowanceUse]:
    """Each of the lab's allowances with the chips it holds against it now."""
    today = today or timezone.localdate()
    ends_on = lab.grant_end_date
    days_left = (ends_on - today).days if ends_on else None
    return [
        AllowanceUse(
            a.generation,
            a.provisioning,
            a.chips,
            holding(lab, a.generation, a.provisioning),
            ends_on,
            days_left,
        )
        for a in LabAllowance.objects.filter(lab=lab)
    ]


ALLOWANCE_SITE_ADMIN_ONLY = (
    "Only a site admin sets what a lab may hold: it comes from the lab's TPU grant."
)
GENERATIONS = ("v2", "v3", "v4", "v5litepod", "v5p", "v6e")


def set_allowance(
    site_admin, lab: Lab, generation: str, provisioning: str, chips: int, *, request=None
):
    """How many chips of a generation and kind the lab may hold at once; 0 removes the
    allowance. Site admins only (it is what the lab's TPU grant says)."""
    if not getattr(site_admin, "is_site_admin", False):
        raise PermissionDenied(ALLOWANCE_SITE_ADMIN_ONLY)
    errors = {}
    if generation not in GENERATIONS:
        errors["generation"] = [f"Choose one of {', '.join(GENERATIONS)}."]
    if provisioning not in Provisioning.values:
        errors["provisioning"] = ["Choose on-demand, spot or preemptible."]
    if not isinstance(chips, int) or not 0 <= chips <= 100_000:
        errors["chips"] = ["A number of chips, 0 to 100000 (0 removes the allowance)."]
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        if chips == 0:
            LabAllowance.objects.filter(
                lab=lab, generation=generation, provisioning=provisioning
            ).delete()
        else:
            LabAllowance.objects.update_or_create(
                lab=lab, generation=generation, provisioning=provisioning, defaults={"chips": chips}
            )
        audit.record(
            AuditAction.ALLOWANCE_SET,
            actor=site_admin,
            lab=lab,
            summary=f"{chips} {provisioning} {generation} chips"
            if chips
            else f"no {provisioning} {generation} chips",
            data={"generation": generation, "provisioning": provisioning, "chips": chips},
            request=request,
        )


# --- the end of the lab's grant -------------------------------------------------------


def warn_grant_ending(days: int = 7, today: dt.date | None = None) -> int:
    """Email a lab's admins once, a week before its TPU grant (and so its allowance)
    ends: what they hold, and that access ends and nothing can be made after it."""
    today = today or timezone.localdate()
    horizon = today + dt.timedelta(days=days)
    warned = 0
    for lab in Lab.objects.filter(grant_end_date__gte=today, grant_end_date__lte=horizon):
        try:
            with transaction.atomic():
                LabNotice.objects.create(
                    lab=lab, kind=LabNotice.Kind.GRANT_ENDING, about=lab.grant_end_date
                )
                emails.send_grant_ending(lab.pk, [u.__dict__ for u in allowance_use(lab)])
        except IntegrityError:  # told already
            continue
        warned += 1
    return warned

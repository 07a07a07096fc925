"""Elastic pools: what a lab's pool of one accelerator type should do now: how many
VMs it should ask Google for (``need``) and which of the VMs it made have sat idle
past its limit (``idle_vms``). It decides only; ``elastic_pass`` does what it decides,
and ``elastic_admin`` keeps the settings a lab admin gives it.

A pool grows for the jobs waiting for its type that no VM of the lab can take, and
only for those whose owners would get an account on the new VM: a person with a kind
grant on the type (``kind_grants``) gets one on every VM of it; a person with a grant
on one named VM never would, so their jobs are not counted. Each VM it asks for takes
one waiting job; the open requests it made and the VMs of the type still idle (being
made, set up, or free) are counted first, so two passes never ask twice for one job.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.db.models import Exists, Max, OuterRef, Q
from django.utils import timezone

from tpus.models import Job, KindGrant, Lab, TpuVm, VmRequest
from tpus.models.elastic import ElasticPool
from tpus.models.grants import KindGrantState
from tpus.models.inventory import NodeState
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState
from tpus.models.provisioning import (
    OPEN_REQUEST_STATES,
    LabAllowance,
    Provisioning,
    VmRequestState,
    chips_of,
)
from tpus.services import allowances, fair_share

POOL_KINDS = (Provisioning.SPOT, Provisioning.PREEMPTIBLE)
# Node states in which a VM of the type takes no job now nor soon.
DOWN = {
    NodeState.PREEMPTED,
    NodeState.TERMINATED,
    NodeState.STOPPED,
    NodeState.STOPPING,
    NodeState.DELETING,
}


def pool_of(lab: Lab, accelerator_type: str) -> ElasticPool | None:
    return ElasticPool.objects.filter(lab=lab, accelerator_type=accelerator_type).first()


def made_text(pool: ElasticPool) -> str:
    """What a VM's page says of a VM the pool made."""
    return (
        f"made by the {pool.accelerator_type} elastic pool; deleted after "
        f"{pool.idle_minutes} min idle"
    )


# --- who the pool grows for ---------------------------------------------------------------


def kind_granted(lab_id: int, accelerator_type: str) -> set[int]:
    """The people with a kind grant in force on the type: each gets an account on any
    VM of it the pool makes."""
    today = timezone.localdate()
    return set(
        KindGrant.objects.filter(
            lab_id=lab_id, accelerator_type=accelerator_type, state=KindGrantState.ACTIVE
        )
        .filter(Q(expires_on__isnull=True) | Q(expires_on__gt=today))
        .values_list("user_id", flat=True)
    )


def on_for(lab_id: int, kinds: set[str]) -> tuple[dict[str, tuple[str, ...]], dict[str, set[int]]]:
    """Of ``kinds``, those whose elastic pool is on (type → its zones), and the people
    each grows for (type → users with a kind grant in force): two queries."""
    zones = {
        kind: tuple(pool_zones)
        for kind, pool_zones in ElasticPool.objects.filter(
            lab_id=lab_id, accelerator_type__in=kinds, enabled=True
        ).values_list("accelerator_type", "zones")
    }
    people: dict[str, set[int]] = {kind: set() for kind in zones}
    if zones:
        today = timezone.localdate()
        for kind, user_id in (
            KindGrant.objects.filter(
                lab_id=lab_id, accelerator_type__in=list(zones), state=KindGrantState.ACTIVE
            )
            .filter(Q(expires_on__isnull=True) | Q(expires_on__gt=today))
            .values_list("accelerator_type", "user_id")
        ):
            people[kind].add(user_id)
    return zones, people


@dataclass(frozen=True)
class Waiting:
    id: int
    user_id: int
    zones: tuple[str, ...]
    provisioning: str


@dataclass(frozen=True)
class Slot:
    """A VM of the type (or one the pool asked for) that a waiting job may still take."""

    zone: str
    spot: bool


def _fits(job: Waiting, slot: Slot) -> bool:
    if job.zones and slot.zone not in job.zones:
        return False
    if job.provisioning == Provisioning.ON_DEMAND:
        return not slot.spot
    if job.provisioning == Provisioning.SPOT:
        return slot.spot
    return True


def pool_may_take(pool: ElasticPool, job: Waiting) -> bool:
    """A VM of the pool (spot or preemptible, in one of its zones) suits the job."""
    if job.provisioning == Provisioning.ON_DEMAND:
        return False
    return not job.zones or bool(set(job.zones) & set(pool.zones))


@dataclass(frozen=True)
class SwitchedOn:
    """A lab's elastic pool of a type that is on, and the people it grows for (user
    ids with a kind grant in force on the type), read together (``switched_on``)."""

    pool: ElasticPool
    granted: set[int]

    def grows_for(self, user, zones, provisioning: str) -> bool:
        """The pool would make a VM the person's job may run on (they have a kind grant
        on the type; its zones and kind suit): a job of theirs may wait for it though
        no VM of the type is there yet."""
        if user.pk not in self.granted:
            return False
        return pool_may_take(self.pool, Waiting(0, user.pk, tuple(zones), provisioning))


def switched_on(lab: Lab, accelerator_type: str) -> SwitchedOn | None:
    """The lab's pool of the type with the people it grows for, if it is on."""
    pool = ElasticPool.objects.filter(
        lab=lab, accelerator_type=accelerator_type, enabled=True
    ).first()
    return None if pool is None else SwitchedOn(pool, kind_granted(lab.pk, accelerator_type))


@dataclass
class Scene:
    """What the pool's decision reads of the lab, at once."""

    pool: ElasticPool
    # Waiting jobs of the type whose owners have a kind grant on it, first come first.
    waiting: list[Waiting]
    # Waiting jobs of the type the pool never grows for (no kind grant, on-demand, zones).
    not_counted: int
    # VMs of the type (any) that take no job now and are up or coming up.
    idle: list[Slot]
    # The pool's open requests (``Slot``s in their zones).
    asked: list[Slot]
    # The pool's VMs there now (not deleted, not deleting).
    alive: int
    # Chips of the pool's generation and kind the lab holds, and its allowance (None: none).
    used_chips: int
    allowance_chips: int | None
    waiting_at_google: int = 0


def read(pool: ElasticPool, *, granted: set[int] | None = None) -> Scene:
    """The pool's scene, in a constant number of queries (``granted``: the people with
    a kind grant in force on the type, when the caller has just read them)."""
    if granted is None:
        granted = kind_granted(pool.lab_id, pool.accelerator_type)
    rows = list(
        Job.objects.filter(
            lab_id=pool.lab_id,
            vm__isnull=True,
            state=JobState.QUEUED,
            accelerator_type=pool.accelerator_type,
        )
        .order_by("queued_at", "id")
        .values_list("id", "user_id", "zones", "provisioning")
    )
    lab = pool.lab
    # A person's chips running now plus one VM of the type each for their jobs counted
    # before: past the lab's limit per person the job would not be placed on a new VM
    # either, so it asks for none (it waits for their own jobs to end).
    limit = lab.max_chips_per_person
    _, chips = chips_of(pool.accelerator_type)
    held: Counter = Counter()
    if limit:
        _, held = fair_share.live_figures(
            fair_share.live_jobs(pool.lab_id, {row[1] for row in rows}, timezone.now()),
            timezone.now(),
            dt.timedelta(days=1),
        )
    waiting, not_counted = [], 0
    for pk, user_id, zones, provisioning in rows:
        job = Waiting(pk, user_id, tuple(zones or ()), provisioning)
        within = not limit or held[user_id] + chips <= limit
        if user_id in granted and within and pool_may_take(pool, job):
            waiting.append(job)
            held[user_id] += chips
        else:
            not_counted += 1
    busy = Job.objects.filter(vm=OuterRef("pk"), state__in=[*WAITING_STATES, *ACTIVE_STATES])
    idle = [
        Slot(zone, spot)
        for zone, spot in TpuVm.objects.filter(
            lab_id=pool.lab_id, accelerator_type=pool.accelerator_type, missing_since__isnull=True
        )
        .exclude(state__in=DOWN)
        .annotate(busy=Exists(busy))
        .filter(busy=False, outside_holders=[])
        .values_list("zone", "preemptible")
    ]
    asked = [
        Slot(zone, True)
        for zone in VmRequest.objects.filter(
            elastic_pool=pool, state__in=OPEN_REQUEST_STATES
        ).values_list("zone", flat=True)
    ]
    waiting_at_google = VmRequest.objects.filter(
        elastic_pool=pool, state=VmRequestState.WAITING
    ).count()
    alive = pool_vms(pool).exclude(state=NodeState.DELETING).count()
    generation, _ = chips_of(pool.accelerator_type)
    allowance = LabAllowance.objects.filter(
        lab=lab, generation=generation, provisioning=pool.provisioning
    ).first()
    return Scene(
        pool,
        waiting,
        not_counted,
        idle,
        asked,
        alive,
        allowances.holding(lab, generation, pool.provisioning),
        allowance.chips if allowance else None,
        waiting_at_google,
    )


def pool_vms(pool: ElasticPool):
    """The VMs the pool made that are still there (not deleted)."""
    return TpuVm.objects.filter(requests__elastic_pool=pool, missing_since__isnull=True).distinct()


@dataclass(frozen=True)
class Need:
    """How many VMs the pool should ask for now, in which zones, and why in words."""

    zones: list[str]
    # Waiting jobs no VM there or asked for can take.
    uncovered: int
    reason: str
    # Why it asks for fewer than ``uncovered`` (blank when it asks for all).
    refused: str = ""

    @property
    def count(self) -> int:
        return len(self.zones)


def allowance_text(scene: Scene, extra: int = 0) -> str:
    """ "allowance 2 of 5 v4-8 in use" (in VMs of the type when they divide it, else
    chips)."""
    _, chips = chips_of(scene.pool.accelerator_type)
    used = scene.used_chips + extra * chips
    kind = scene.pool.get_provisioning_display().lower()
    if scene.allowance_chips is None:
        return f"no {kind} allowance for {scene.pool.accelerator_type}"
    if chips and scene.allowance_chips % chips == 0 and used % chips == 0:
        return (
            f"allowance {used // chips} of {scene.allowance_chips // chips} "
            f"{kind} {scene.pool.accelerator_type} in use"
        )
    return f"allowance {used} of {scene.allowance_chips} {kind} chips in use"


def reason(scene: Scene, asked: int = 0) -> str:
    """Why the pool asks: "3 jobs wait; allowance 2 of 5 spot v4-8 in use" (with
    ``asked`` more asked for in this pass)."""
    waits = len(scene.waiting)
    words = f"{waits} job{'s' if waits != 1 else ''} wait{'s' if waits == 1 else ''}"
    return f"{words}; {allowance_text(scene, asked)}"


def need(scene: Scene, today: dt.date | None = None) -> Need:
    """Pure: each counted waiting job takes the first idle VM or open request it fits
    (first come, first served); each left over wants a VM of its own, in the first of
    the pool's zones it may run in. Capped by the pool's maximum, by the allowance
    (as the chips stand now; the claim counts again under the lab's lock) and by the
    lab's grant."""
    pool = scene.pool
    slots = [*scene.idle, *scene.asked]
    left = []
    for job in scene.waiting:
        for slot in slots:
            if _fits(job, slot):
                slots.remove(slot)
                break
        else:
            left.append(job)
    reason_now = reason(scene)
    if not left:
        return Need([], 0, reason_now)
    wanted = []
    for job in left:
        zones = [z for z in pool.zones if not job.zones or z in job.zones]
        wanted.append(zones[(pool.next_number + len(wanted)) % len(zones)])
    refused = ""
    if allowances.grant_ended(pool.lab):
        refused = f"the lab's TPU grant ended on {pool.lab.grant_end_date:%-d %B %Y}; no VM is made"
        wanted = []
    if pool.max_vms is not None:
        room = max(0, pool.max_vms - scene.alive - len(scene.asked))
        if room < len(wanted):
            wanted = wanted[:room]
            refused = f"the pool holds its maximum of {pool.max_vms} VMs"
    _, chips = chips_of(pool.accelerator_type)
    if scene.allowance_chips is None:
        if wanted:
            refused = (
                f"the lab has no {pool.get_provisioning_display().lower()} allowance for "
                f"{chips_of(pool.accelerator_type)[0]} chips"
            )
        wanted = []
    else:
        room = max(0, (scene.allowance_chips - scene.used_chips) // max(chips, 1))
        if room < len(wanted):
            wanted = wanted[:room]
            refused = f"allowance full: {allowance_text(scene, room)}"
    return Need(wanted, len(left), reason_now, refused)


# --- shrinking ----------------------------------------------------------------------------


@dataclass(frozen=True)
class IdleVm:
    vm_id: int
    name: str
    zone: str
    spot: bool
    state: str
    idle_since: dt.datetime

    def due(self, pool: ElasticPool, now: dt.datetime) -> bool:
        return now - self.idle_since >= dt.timedelta(minutes=pool.idle_minutes)


def idle_vms(pool: ElasticPool) -> list[IdleVm]:
    """The pool's VMs on which no job is placed, starting or running, each with when
    it last had one (or came up, when it never had one)."""
    busy = Job.objects.filter(vm=OuterRef("pk"), state__in=[*WAITING_STATES, *ACTIVE_STATES])
    rows = (
        pool_vms(pool)
        .exclude(state=NodeState.DELETING)
        .annotate(
            busy=Exists(busy),
            last_ended=Max("jobs__ended_at"),
            ready_at=Max("requests__ready_at"),
        )
        .filter(busy=False)
        .values_list(
            "pk", "name", "zone", "preemptible", "state", "last_ended", "ready_at", "created_at"
        )
    )
    out = []
    for pk, name, zone, spot, state, last_ended, ready_at, created_at in rows:
        # Up since its request's end (the row may be older: a name seen before).
        since = max((t for t in (last_ended, ready_at) if t is not None), default=created_at)
        out.append(IdleVm(pk, name, zone, spot, state, since))
    return sorted(out, key=lambda vm: (vm.idle_since, vm.vm_id))


def wanted_by_waiting(scene: Scene, vm: IdleVm) -> bool:
    """A counted waiting job could run on the VM: it is not deleted while one waits."""
    slot = Slot(vm.zone, vm.spot)
    return vm.state not in DOWN and any(_fits(job, slot) for job in scene.waiting)


def made_by(vm: TpuVm) -> ElasticPool | None:
    """The elastic pool that made ``vm``, if one did."""
    return ElasticPool.objects.filter(requests__vm=vm).first()

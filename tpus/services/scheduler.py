"""The pool: which waiting job runs on which free VM of its kind. The one place that
decides it.

A job may ask for a kind of VM of its lab instead of one VM by name: an accelerator
type (``v4-8``), optionally zones and on-demand or spot. Until placed it has no VM.
Placement reads one snapshot of the lab (``load``: a constant number of queries
whatever the number of VMs and jobs), decides without touching the database
(``decide``: pure), and writes each decision as a conditional UPDATE that gives the
job its VM only while it still has none (``place``). From then on the job is a job of
that VM like any other: the VM's pass (``job_engine.advance``) validates and starts
it, holding the VM's place as any job of it does.

A VM is free for the pool when it is READY, listed by Google, not being set up again,
no job holds or waits for it, and the last look at its chips found nothing holding
them outside the portal. A job goes only where its person has an active grant.

Order: a job back from a lost VM (preempted, under maintenance, deleted; its owner
asked to run it again) is at the head of its kind's line, first come first served
among such jobs (``returned_first``); its owner is told where it went once it is
placed. The rest of a kind's line is served by fair share (``fair_share_order``): the
jobs of the person with the least recent use for their share first, first come, first served
within one person (``services.fair_share`` keeps the figures); a job that cannot go on
any free VM (no grant there, the person's chip limit) lets the next one in line have
it. Placement takes the lab's row lock for its few queries only, so two placements of
one lab never give one VM two jobs; it never waits on a worker.
"""

from __future__ import annotations

import bisect
import datetime as dt
import functools
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import (
    Case,
    Exists,
    IntegerField,
    OuterRef,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Cast
from django.utils import timezone

from portal import audit
from portal.audit import AuditAction
from tpus import queue
from tpus.models import Grant, Job, Lab, TpuVm
from tpus.models.grants import GrantState
from tpus.models.inventory import chip_count
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState, Provisioning
from tpus.services import elastic_pools, emails, fair_share

# --- the snapshot --------------------------------------------------------------------


@dataclass(slots=True)
class VmRow:
    id: int
    name: str
    accelerator_type: str
    zone: str
    spot: bool
    # Free for the pool now (see the module's text).
    free: bool
    chips: int


@dataclass(slots=True)
class JobRow:
    id: int
    user_id: int
    accelerator_type: str
    zones: tuple[str, ...]
    provisioning: str
    # Its place among the lab's waiting pool jobs by submission (queued_at, then id).
    seq: int
    # When it went back to the head of its kind's line, its VM lost (None: never).
    returned_at: dt.datetime | None = None

    def fits(self, vm: VmRow) -> bool:
        """The VM is of the kind the job asked for."""
        if vm.accelerator_type != self.accelerator_type:
            return False
        if self.zones and vm.zone not in self.zones:
            return False
        if self.provisioning == Provisioning.SPOT:
            return vm.spot
        if self.provisioning == Provisioning.ON_DEMAND:
            return not vm.spot
        return True


@dataclass
class Snapshot:
    """What placement needs of one lab, read at once."""

    lab_id: int
    max_chips_per_person: int
    vms: list[VmRow]
    jobs: list[JobRow]
    # (user id, VM id) of the active grants on ``vms``.
    grants: set[tuple[int, int]]
    # Chips each person's jobs hold now (validating to cancelling).
    chips_held: Counter = field(default_factory=Counter)
    # Each waiting person's recent use (decayed chip-hours, as of when it was read)
    # and share; someone missing has used nothing and has a share of 1.
    use: dict[int, float] = field(default_factory=dict)
    shares: dict[int, float] = field(default_factory=dict)
    # Read for ``reasons`` only: the kinds whose elastic pool is on (type → zones), and
    # the people it grows for (type → user ids with a kind grant).
    elastic: dict[str, tuple[str, ...]] = field(default_factory=dict)
    elastic_people: dict[str, set[int]] = field(default_factory=dict)

    def use_per_share(self, user_id: int) -> float:
        return self.use.get(user_id, 0.0) / self.shares.get(user_id, fair_share.DEFAULT_SHARE)

    @functools.cached_property
    def per_share(self) -> dict[int, float]:
        """``use_per_share`` of each waiting person, worked out once."""
        return {job.user_id: self.use_per_share(job.user_id) for job in self.jobs}


def load(lab_id: int, accelerator_type: str | None = None, *, every_vm: bool = False) -> Snapshot:
    """What placement needs of the lab's pool (of one kind, or all), in at most five
    queries whatever the number of VMs, jobs and grants: its free VMs of the kinds
    jobs wait for; the jobs waiting for those kinds; the lab's limit and half-life with
    the fair-share rows of the people waiting (one row each); the grants on those VMs;
    and the waiting people's live jobs (what they hold now, and their use not in the
    rows yet). With ``every_vm``, the busy VMs of those kinds too, and every waiting
    job (``reasons`` says why each waits)."""
    now = timezone.now()
    waiting = Job.objects.filter(lab_id=lab_id, vm__isnull=True, state__in=WAITING_STATES)
    if accelerator_type is not None:
        waiting = waiting.filter(accelerator_type=accelerator_type)
    taken = Job.objects.filter(vm=OuterRef("pk"), state__in=[*ACTIVE_STATES, *WAITING_STATES])
    vms = TpuVm.objects.filter(
        lab_id=lab_id, accelerator_type__in=waiting.values("accelerator_type")
    ).annotate(taken=Exists(taken))
    if not every_vm:
        vms = vms.filter(**FREE).exclude(taken=True)
    rows = [
        VmRow(
            id=pk,
            name=name,
            accelerator_type=kind,
            zone=zone,
            spot=spot,
            free=(
                state == TpuVm.State.READY
                and missing is None
                and restoring is None
                and not holders
                and not busy
            ),
            chips=chip_count(kind),
        )
        for pk, name, kind, zone, spot, state, missing, restoring, holders, busy in vms.order_by(
            "name", "id"
        ).values_list(
            "id",
            "name",
            "accelerator_type",
            "zone",
            "preemptible",
            "state",
            "missing_since",
            "restore_version",
            "outside_holders",
            "taken",
        )
    ]
    if not rows and not every_vm:
        return Snapshot(lab_id, 0, [], [], set())
    if not every_vm:
        waiting = waiting.filter(accelerator_type__in={vm.accelerator_type for vm in rows})
    jobs = [
        JobRow(pk, user_id, kind, _zones(zones), provisioning, seq, returned_at)
        for seq, (pk, user_id, kind, zones, provisioning, returned_at) in enumerate(
            waiting.order_by("queued_at", "id").values_list(
                "id",
                "user_id",
                "accelerator_type",
                Cast("zones", TextField()),
                "provisioning",
                "returned_at",
            )
        )
    ]
    if not jobs:
        return Snapshot(lab_id, 0, rows, [], set())
    people = {job.user_id for job in jobs}
    lab, half, stored, shares = fair_share.lab_standings(lab_id, people, now)
    grants = set(
        Grant.objects.filter(vm_id__in=[vm.id for vm in rows], state=GrantState.ACTIVE)
        .values_list("user_id", "vm_id")
        .order_by()
    )
    live_use, held = fair_share.live_figures(fair_share.live_jobs(lab_id, people, now), now, half)
    use = {user_id: stored.get(user_id, 0.0) + live_use.get(user_id, 0.0) for user_id in people}
    snapshot = Snapshot(lab_id, lab, rows, jobs, grants, held, use, shares)
    if every_vm:
        snapshot.elastic, snapshot.elastic_people = elastic_pools.on_for(
            lab_id, {job.accelerator_type for job in jobs}
        )
    return snapshot


def _zones(text: str | None) -> tuple[str, ...]:
    """A waiting job's zones from their JSON text: most jobs name none, and reading
    2,000 JSON values one by one was a third of the snapshot's time."""
    if not text or text == "[]":
        return ()
    return tuple(json.loads(text))


# What makes a VM free for the pool, as a filter (``VmRow.free`` says the same).
FREE = {
    "state": TpuVm.State.READY,
    "missing_since__isnull": True,
    "restore_version__isnull": True,
    "outside_holders": [],
}


# --- the decision --------------------------------------------------------------------


def fifo(job: JobRow, snapshot: Snapshot):
    """First come, first served (a sort key of a kind's line), after the jobs back
    from a lost VM (``returned_first``)."""
    return returned_first(job) or (1, job.seq)


def fair_share_order(job: JobRow, snapshot: Snapshot):
    """Fair share: the order a kind's line is served in (a sort key). The jobs back
    from a lost VM first (``returned_first``); then the jobs of the person with the
    least recent use for their share; first come, first served within one person and
    between equals."""
    return returned_first(job) or (1, snapshot.per_share[job.user_id], job.seq)


def returned_first(job: JobRow) -> tuple | None:
    """The head of the line: a job run again after its VM was lost (preempted, under
    maintenance, deleted) goes before every other of its kind, in the order they came
    back (first come, first served among them); None for any other job."""
    if job.returned_at is None:
        return None
    return (0, job.returned_at, job.seq)


@dataclass(frozen=True)
class Placement:
    job_id: int
    vm_id: int


def decide(
    snapshot: Snapshot, *, order_key: Callable[[JobRow, Snapshot], object] = fair_share_order
) -> list[Placement]:
    """For each free VM, the next job of its kind that may go there: in the order of
    ``order_key``, each job on the first free VM (by name) it fits, whose person has
    an active grant on it, within the person's chip limit. Touches no database."""
    free: dict[str, list[VmRow]] = defaultdict(list)
    for vm in snapshot.vms:
        if vm.free:
            free[vm.accelerator_type].append(vm)
    limit = snapshot.max_chips_per_person
    held = Counter(snapshot.chips_held)
    placements = []
    for job in sorted(snapshot.jobs, key=lambda j: order_key(j, snapshot)):
        vms = free.get(job.accelerator_type)
        if not vms:
            continue
        for vm in vms:
            if not job.fits(vm) or (job.user_id, vm.id) not in snapshot.grants:
                continue
            if limit and held[job.user_id] + vm.chips > limit:
                break
            placements.append(Placement(job.id, vm.id))
            held[job.user_id] += vm.chips
            vms.remove(vm)
            break
    return placements


@dataclass(frozen=True)
class Line:
    """A waiting pool job's place in its kind's line (1: next) and why it waits."""

    place: int
    reason: str


def reasons(
    snapshot: Snapshot, *, order_key: Callable[[JobRow, Snapshot], object] = fair_share_order
) -> dict[int, str]:
    """Why each waiting pool job of the snapshot still waits, in words: "All 12 v4-8
    you may use are busy; 3 jobs before yours.", and when jobs submitted after it go
    first, that its person's recent use is above their share. Pure, like ``decide``."""
    return {pk: line.reason for pk, line in lines(snapshot, order_key=order_key).items()}


def lines(
    snapshot: Snapshot, *, order_key: Callable[[JobRow, Snapshot], object] = fair_share_order
) -> dict[int, Line]:
    """Each waiting pool job's ``Line``: its place and ``reasons``'s words. Pure."""
    ahead: Counter = Counter()
    # The submission places (``seq``) of the jobs ahead, per kind, sorted: those after
    # a job's own were put ahead of it by fair share.
    seqs_ahead: dict[str, list[int]] = defaultdict(list)
    out = {}
    limit = snapshot.max_chips_per_person
    by_kind: dict[str, list[VmRow]] = defaultdict(list)
    for vm in snapshot.vms:
        by_kind[vm.accelerator_type].append(vm)
    for job in sorted(snapshot.jobs, key=lambda j: order_key(j, snapshot)):
        before = ahead[job.accelerator_type]
        ahead[job.accelerator_type] += 1
        seqs = seqs_ahead[job.accelerator_type]
        overtaken = len(seqs) - bisect.bisect_right(seqs, job.seq)
        if job.returned_at is None:
            # A job back from a lost VM is ahead of all: no one's share put it there.
            bisect.insort(seqs, job.seq)
        line = f"{before} job{'s' if before != 1 else ''} before yours."
        usable = [
            vm
            for vm in by_kind[job.accelerator_type]
            if job.fits(vm) and (job.user_id, vm.id) in snapshot.grants
        ]
        held = snapshot.chips_held[job.user_id]
        elastic = _elastic_reason(snapshot, job, usable)
        if elastic:
            out[job.id] = Line(before + 1, f"{elastic} {line[:1].upper()}{line[1:]}")
            continue
        if not usable:
            text = f"You have active access to no {job_text(job)} of this lab; ask a lab admin."
        elif limit and held + min(vm.chips for vm in usable) > limit:
            text = (
                f"Your running jobs hold {held} chip{'s' if held != 1 else ''}; this lab "
                f"allows {limit} at once per person."
            )
        elif any(vm.free for vm in usable):
            text = f"A free {job.accelerator_type} is being given to it."
        else:
            count = len(usable)
            verb = "are" if count != 1 else "is"
            text = f"All {count} {job_text(job)} you may use {verb} busy;"
            if overtaken:
                text += f" {above_share(snapshot, job.user_id)}, so others' jobs go first;"
            out[job.id] = Line(before + 1, f"{text} {line}")
            continue
        out[job.id] = Line(before + 1, f"{text} {line[:1].upper()}{line[1:]}")
    return out


def _elastic_reason(snapshot: Snapshot, job: JobRow, usable: list[VmRow]) -> str:
    """Why a job of a kind whose elastic pool is on waits, when no VM it may use is
    free: the pool asks Google for one for the people with a kind grant on the type;
    anyone else's job is not counted (no VM it makes would be theirs). Blank otherwise."""
    zones = snapshot.elastic.get(job.accelerator_type)
    if zones is None or any(vm.free for vm in usable):
        return ""
    kind = job.accelerator_type
    fits = job.provisioning != Provisioning.ON_DEMAND and (
        not job.zones or set(job.zones) & set(zones)
    )
    if job.user_id not in snapshot.elastic_people.get(kind, set()):
        return (
            f"The {kind} elastic pool makes VMs only for people with access to every "
            f"{kind} (a kind grant); you have none, so it asks for no VM for this job."
        )
    if not fits:
        return (
            f"The {kind} elastic pool makes spot or preemptible VMs in "
            f"{', '.join(zones)} only, which this job does not take."
        )
    return (
        f"No {job_text(job)} you may use is free; the {kind} elastic pool has asked Google "
        "for a VM for it (you get an account there by your access to every "
        f"{kind}), or says on the kinds page why it cannot."
    )


def above_share(snapshot: Snapshot, user_id: int) -> str:
    use = snapshot.use.get(user_id, 0.0)
    share = snapshot.shares.get(user_id, fair_share.DEFAULT_SHARE)
    return f"your recent use is above your share ({use:.1f} chip-hours for a share of {share:g})"


def why_they_wait(lab_id: int, accelerator_type: str | None = None) -> dict[int, str]:
    """``reasons`` for the lab's waiting pool jobs (of one kind, or all), read in a
    constant number of queries."""
    return reasons(load(lab_id, accelerator_type, every_vm=True))


def waiting_lines(lab_id: int, accelerator_type: str | None = None) -> dict[int, Line]:
    """``lines`` of the lab's waiting pool jobs (of one kind, or all), read in a
    constant number of queries."""
    return lines(load(lab_id, accelerator_type, every_vm=True))


def job_text(job: JobRow) -> str:
    words = job.accelerator_type
    if job.zones:
        words += " in " + ", ".join(job.zones)
    if job.provisioning == Provisioning.SPOT:
        words += " (spot)"
    elif job.provisioning == Provisioning.ON_DEMAND:
        words += " (on-demand)"
    return words


# --- doing it ------------------------------------------------------------------------


def place(
    lab_id: int, accelerator_type: str | None = None, *, in_pass_of: int | None = None
) -> list[Placement]:
    """Give the lab's waiting pool jobs (of one kind, or all) the free VMs they may
    run on, and queue each VM's pass to start its job; a VM whose own pass is placing
    (``in_pass_of``) starts its job in that pass. Returns what was placed."""
    with transaction.atomic():
        # One placement of a lab at a time, for its few queries: two cannot both see a
        # VM free and give it a job each.
        if not Lab.objects.select_for_update().filter(pk=lab_id).exists():
            return []
        snapshot = load(lab_id, accelerator_type)
        decided = decide(snapshot)
        if not decided:
            return []
        # One conditional UPDATE for every decision: a job gets its VM only while it
        # still waits without one (a cancel meanwhile wins).
        now = timezone.now()
        vm_of = Case(
            *(When(pk=p.job_id, then=Value(p.vm_id)) for p in decided),
            output_field=IntegerField(),
        )
        updated = Job.objects.filter(
            pk__in=[p.job_id for p in decided], vm__isnull=True, state=JobState.QUEUED
        ).update(vm_id=vm_of, placed_at=now, changed_at=now, reason="")
        placed = decided
        if updated != len(decided):
            # Some were cancelled (or placed) meanwhile: which ones took their VM.
            taken = set(
                Job.objects.filter(pk__in=[p.job_id for p in decided], placed_at=now).values_list(
                    "pk", "vm_id"
                )
            )
            placed = [p for p in decided if (p.job_id, p.vm_id) in taken]
        for placement in placed:
            if placement.vm_id != in_pass_of:
                queue.advance_jobs(placement.vm_id)
        # A job's ``returned_at`` is set when it is made: the snapshot's is the row's.
        returned = {job.id for job in snapshot.jobs if job.returned_at is not None}
        _tell_moved([p.job_id for p in placed if p.job_id in returned])
    return placed


def _tell_moved(job_ids: list[int]) -> None:
    """Jobs back from a lost VM that were just placed: each move in the audit, and one
    email to its owner saying where it went ("tpu7 was preempted; your job moved to
    tpu3"). A job is placed once, so each hears once."""
    if not job_ids:
        return
    moved = Job.objects.filter(pk__in=job_ids, returned_at__isnull=False).select_related(
        "vm__lab", "user"
    )
    for job in moved:
        audit.record(
            AuditAction.JOB_MOVED,
            lab=job.vm.lab,
            target_user=job.user,
            summary=f"job {job.pk} (run {job.attempt} of job {job.rerun_of_id}): {job.move_text}",
            data={
                "job": job.pk,
                "rerun_of": job.rerun_of_id,
                "attempt": job.attempt,
                "from": job.moved_from,
                "vm": job.vm_id,
            },
        )
        emails.send_job_moved(job.pk)


def labs_with_waiting_jobs() -> list[int]:
    """Labs with a pool job still waiting for a VM (the job poll places theirs)."""
    return list(
        Job.objects.filter(vm__isnull=True, state__in=WAITING_STATES)
        .values_list("lab_id", flat=True)
        .distinct()
        .order_by("lab_id")
    )


def place_all() -> int:
    """Placement for every lab with pool jobs waiting; how many were placed."""
    return sum(len(place(lab_id)) for lab_id in labs_with_waiting_jobs())

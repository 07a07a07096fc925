"""Fair share of a lab's pool: each person's recent use of the lab's TPUs against the
share the lab gives them. The scheduler serves a kind's waiting jobs in the order of
their people's recent use divided by their shares (``scheduler.fair_share``).

Recent use is chip-hours with exponential decay: a chip-hour used one half-life ago
(the lab's, 7 days unless set) counts half, two half-lives ago a quarter. It is kept
per (lab, person) in one row (``FairShare``) as a value and the time it was decayed
to, so reading it costs one row per person whatever they ran. Usage's count of ended
jobs (``usage.count_ended_jobs``) adds each job to the row once, in the transaction
that marks the job counted; until then a job (running, or ended since the last count)
is read from the jobs, as usage reads it: one query for the few such jobs.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.db.models import (
    DateTimeField,
    DecimalField,
    DurationField,
    ExpressionWrapper,
    F,
    FloatField,
    IntegerField,
    Q,
    QuerySet,
    Value,
)
from django.utils import timezone

from portal import audit
from portal.audit import AuditAction
from tpus.models import FairShare, Job, Lab
from tpus.models.fair_share import MAX_SHARE, MIN_SHARE
from tpus.models.inventory import chip_count
from tpus.models.jobs import ACTIVE_STATES

DEFAULT_SHARE = 1.0
CENTS = Decimal("0.01")


class ShareError(ValueError):
    """A share that cannot be set; the message says why, for people."""


# --- the arithmetic (pure) -----------------------------------------------------------


def half_life(days) -> dt.timedelta:
    """The lab's half-life (``Lab.fair_share_half_life_days``) as a duration."""
    return dt.timedelta(days=float(days))


def decay(value: float, since: dt.datetime, now: dt.datetime, half: dt.timedelta) -> float:
    """``value``, as it was at ``since``, as of ``now``: halved every ``half``."""
    if not value or now <= since:
        return value
    return value * 2 ** (-((now - since) / half))


def job_use(
    chips: int,
    started: dt.datetime,
    ended: dt.datetime | None,
    now: dt.datetime,
    half: dt.timedelta,
) -> float:
    """The decayed chip-hours, as of ``now``, of a job holding ``chips`` chips from
    ``started`` to ``ended`` (until ``now`` while it runs). Each moment of it counts
    2^-(its age / half-life), so the sum is chips × half-life / ln 2 × (2^-(age of its
    end) − 2^-(age of its start)) in hours; for a job much shorter than the half-life,
    close to chips × hours, decayed from its end."""
    end = min(ended or now, now)
    if end <= started:
        return 0.0
    hours = half / dt.timedelta(hours=1)
    since_end = (now - end) / half
    length = (end - started) / half
    # 2^-a − 2^-(a+b) = −2^-a · (e^(−b ln 2) − 1), exact for short jobs too.
    return chips * hours / math.log(2) * 2 ** (-since_end) * -math.expm1(-length * math.log(2))


def live_figures(jobs: Iterable[tuple], now: dt.datetime, half: dt.timedelta):
    """(decayed chip-hours per person, chips held now per person) of ``jobs``, rows of
    ``live_jobs`` read as of ``now``: those not in the rows yet."""
    use: dict[int, float] = defaultdict(float)
    held: Counter = Counter()
    for user_id, accelerator_type, state, started_ago, ended_ago in jobs:
        chips = chip_count(accelerator_type)
        if state in ACTIVE_STATES:
            held[user_id] += chips
        if started_ago is not None:
            ended = now - ended_ago if ended_ago is not None else None
            use[user_id] += job_use(chips, now - started_ago, ended, now, half)
    return dict(use), held


# --- reading -------------------------------------------------------------------------


def live_jobs(lab_id: int, user_ids: Iterable[int], now: dt.datetime) -> QuerySet:
    """The jobs of ``user_ids`` on the lab's VMs that hold chips now or whose use is
    not in the rows yet: running ones and those ended since the last count, a few per
    VM at most. Rows of (user id, the VM's accelerator type, state, how long ago it
    started and ended as of ``now``), for ``live_figures``. (Durations rather than
    times: the database's answer is read faster.)"""
    return (
        Job.objects.filter(vm__lab_id=lab_id, user_id__in=list(user_ids))
        .filter(Q(state__in=ACTIVE_STATES) | Q(started_at__isnull=False, usage_counted=False))
        .order_by()
        .values_list(
            "user_id",
            "vm__accelerator_type",
            "state",
            ExpressionWrapper(Value(now) - F("started_at"), DurationField()),
            ExpressionWrapper(Value(now) - F("ended_at"), DurationField()),
        )
    )


@dataclass(frozen=True)
class Standing:
    """A person's standing in a lab's pool as of a moment."""

    share: float
    # Chip-hours, decayed.
    use: float
    # Chips their jobs hold now.
    running_chips: int = 0


def standings(lab: Lab, user_ids: Iterable[int], now: dt.datetime | None = None) -> dict:
    """``{user id: Standing}`` for ``user_ids`` in ``lab``: two queries, whatever they
    ran (their rows, and their live jobs)."""
    now = now or timezone.now()
    user_ids = list(user_ids)
    half = half_life(lab.fair_share_half_life_days)
    rows = {
        user_id: (float(share), decay(use, decayed_at, now, half))
        for user_id, share, use, decayed_at in FairShare.objects.filter(
            lab=lab, user_id__in=user_ids
        ).values_list("user_id", "share", "use", "decayed_at")
    }
    live_use, held = live_figures(live_jobs(lab.pk, user_ids, now), now, half)
    found = {}
    for user_id in user_ids:
        share, use = rows.get(user_id, (DEFAULT_SHARE, 0.0))
        found[user_id] = Standing(share, use + live_use.get(user_id, 0.0), held[user_id])
    return found


def lab_standings(lab_id: int, people: set[int], now):
    """(``lab_id``'s chip limit per person, its half-life, {person: recent use as of
    ``now``}, {person: share}) for those of ``people`` with a fair-share row; the others
    have used nothing and have a share of 1. One query, the lab's row and the people's
    rows in one result (placement's snapshot reads it: one row per person, not one per
    job)."""
    nothing = [Value(None, output_field=f) for f in _STANDING_FIELDS]
    lab = (
        Lab.objects.filter(pk=lab_id)
        .order_by()
        .values_list("max_chips_per_person", "fair_share_half_life_days", *nothing)
    )
    rows = (
        FairShare.objects.filter(lab_id=lab_id, user_id__in=sorted(people))
        .order_by()
        .values_list(
            Value(None, output_field=IntegerField()),
            Value(None, output_field=DecimalField(max_digits=5, decimal_places=2)),
            "user_id",
            "share",
            "use",
            "decayed_at",
        )
    )
    limit = days = None
    stored, shares, found = {}, {}, []
    for row in lab.union(rows, all=True):
        if row[2] is None:
            limit, days = row[:2]
        else:
            found.append(row[2:])
    if days is None:
        raise Lab.DoesNotExist(f"No lab {lab_id}.")
    half = half_life(days)
    for user_id, share, use, decayed_at in found:
        shares[user_id] = float(share)
        stored[user_id] = decay(use, decayed_at, now, half)
    return limit, half, stored, shares


_STANDING_FIELDS = (
    IntegerField(),
    DecimalField(max_digits=7, decimal_places=2),
    FloatField(),
    DateTimeField(),
)


# --- counting ended jobs -------------------------------------------------------------


def count_ended(jobs: list, now: dt.datetime) -> None:
    """Add ended jobs to their people's rows (usage's count calls this in the
    transaction that marks them counted): each job has ``vm_lab_id``,
    ``vm_accelerator_type``, ``user_id``, ``started_at`` and ``ended_at``. Three
    queries: the labs' half-lives, the rows (locked), and one write of each kind."""
    if not jobs:
        return
    halves = {
        pk: half_life(days)
        for pk, days in Lab.objects.filter(pk__in={j.vm_lab_id for j in jobs}).values_list(
            "pk", "fair_share_half_life_days"
        )
    }
    added: dict[tuple[int, int], float] = defaultdict(float)
    for job in jobs:
        half = halves[job.vm_lab_id]
        chips = chip_count(job.vm_accelerator_type)
        added[(job.vm_lab_id, job.user_id)] += job_use(
            chips, job.started_at, job.ended_at, now, half
        )
    existing = {
        (row.lab_id, row.user_id): row
        for row in FairShare.objects.select_for_update().filter(
            lab_id__in={key[0] for key in added}, user_id__in={key[1] for key in added}
        )
    }
    changed, made = [], []
    for (lab_id, user_id), amount in added.items():
        row = existing.get((lab_id, user_id))
        if row is None:
            made.append(FairShare(lab_id=lab_id, user_id=user_id, use=amount, decayed_at=now))
            continue
        row.use = decay(row.use, row.decayed_at, now, halves[lab_id]) + amount
        row.decayed_at = now
        changed.append(row)
    FairShare.objects.bulk_update(changed, ["use", "decayed_at"], batch_size=500)
    # Two counts making one person's row at once: the second's transaction fails on
    # the unique constraint and rolls back whole; the next count adds its jobs.
    FairShare.objects.bulk_create(made, batch_size=500)


def forget_use() -> None:
    """Every row's use back to none (usage counts every job again after this)."""
    FairShare.objects.update(use=0.0, decayed_at=timezone.now())


# --- a lab admin sets a share --------------------------------------------------------


def clean_share(value) -> Decimal:
    """A share as typed: a number from 0.01 to 1000, at most two decimals."""
    try:
        share = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise ShareError("A share is a number, such as 1, 2 or 0.5.") from None
    if not share.is_finite() or not MIN_SHARE <= share <= MAX_SHARE:
        raise ShareError(f"A share is from {MIN_SHARE} to {MAX_SHARE:.0f}.")
    if share != share.quantize(CENTS):
        raise ShareError("A share has at most two decimals.")
    return share.quantize(CENTS)


@transaction.atomic
def set_share(admin, membership, value, *, request=None) -> FairShare:
    """Give a member of the lab a share of its pool (1 unless set). Setting the share
    a person has changes nothing and records nothing."""
    share = clean_share(value)
    row, _ = FairShare.objects.select_for_update().get_or_create(
        lab_id=membership.lab_id, user_id=membership.user_id
    )
    if row.share == share:
        return row
    old = Decimal(row.share).quantize(CENTS)
    FairShare.objects.filter(pk=row.pk).update(share=share)
    row.share = share
    audit.record(
        AuditAction.SHARE_SET,
        actor=admin,
        lab=membership.lab,
        target_user=membership.user,
        summary=f"share of the pool: {old.normalize():f} → {share.normalize():f}",
        data={"share": {"old": str(old), "new": str(share)}},
        request=request,
    )
    return row

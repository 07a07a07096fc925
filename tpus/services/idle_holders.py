"""The lab's policy on idle chips: who holds a TPU's chips without using them is told,
then the lab's admins, and (when the lab says so) the chips are released.

A holding is a portal job running on the VM (it holds every chip) or a process the
portal did not start with a chip open (``TpuVm.outside_holders``, from the last look).
The pass (``run_pass``, on a schedule) reads what is already stored, the chip samples
the job poll and the holder look keep (``ChipSample``), and asks no worker anything:
a holding is idle since the first sample after which every chip it holds stayed below
the lab's threshold (``Lab.idle_threshold_percent``), and a holding with no sample in
the kept window is not judged. Then, per holding (``IdleHolding``, so no step is taken
twice, each claimed with a conditional update):

1. idle for ``idle_warn_minutes``: the holder is emailed once, with what they hold;
2. ``idle_admins_minutes`` after that: the lab's admins are told and, with
   ``idle_release`` on, the portal ends it: a job is cancelled as a cancel does
   (``jobs.cancel_job``); a process gets TERM, then KILL after
   PORTAL_IDLE_RELEASE_GRACE_SECONDS (``holder-stop.sh``, which signals it only while
   it is still the same process and still holds a chip). The person is told, and the
   VM is free again for the queue.

A holding whose chips are busy again starts over; one that ended by itself is
forgotten; people (``Membership.idle_exempt``) and VMs (``TpuVm.idle_exempt``) the
lab's admin exempted (``idle_exemptions``) are left alone. Every step is in the audit log.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from accounts.models import UnixAccount
from portal import audit
from portal.audit import AuditAction
from tpus import queue
from tpus.models import ChipSample, IdleHolding, Job, JobState, Lab, Membership, TpuVm
from tpus.remote import RemoteError, run_script
from tpus.remote import jobs as wire
from tpus.services import emails, scheduler
from tpus.services.hosts import remote_worker
from tpus.services.job_engine import chip_layout
from tpus.services.jobs import cancel_job
from tpus.services.labkeys import login_for

log = logging.getLogger(__name__)

# Released holdings stay on the VM's page this long.
SHOWN_AFTER_RELEASE = dt.timedelta(days=1)
_NUMBER = re.compile(r"([0-9]+)$")


@dataclass
class Held:
    """One holding as the VM shows it now: its key, whom it concerns, its chips."""

    job: Job | None = None
    worker: int | None = None
    pid: int | None = None
    start: int | None = None
    unix_user: str = ""
    command: str = ""
    person_id: int | None = None
    chips: set[tuple[int, int]] = field(default_factory=set)

    @property
    def key(self) -> tuple:
        return ("job", self.job.pk) if self.job else ("process", self.worker, self.pid, self.start)


@dataclass
class PassReport:
    looked_at: int = 0
    warned: list[int] = field(default_factory=list)
    admins_told: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    reset: list[int] = field(default_factory=list)


def _kept() -> dt.timedelta:
    return dt.timedelta(minutes=settings.PORTAL_CHIP_METRICS_KEEP_MINUTES)


def run_pass(limit: int | None = None, *, now: dt.datetime | None = None) -> PassReport:
    """The scheduled pass: up to ``limit`` (PORTAL_IDLE_PASS_VMS) VMs of labs whose
    policy is on that something holds (a running job, a process outside the portal, or
    a holding the pass follows), least recently looked at first."""
    limit = settings.PORTAL_IDLE_PASS_VMS if limit is None else limit
    now = now or timezone.now()
    report = PassReport()
    running = Job.objects.filter(vm=OuterRef("pk"), state=JobState.RUNNING)
    followed = IdleHolding.objects.filter(vm=OuterRef("pk"), released_at__isnull=True)
    chosen = list(
        TpuVm.objects.filter(lab__idle_policy_enabled=True, missing_since__isnull=True)
        .alias(running=Exists(running), followed=Exists(followed))
        .filter(Q(running=True) | Q(followed=True) | ~Q(outside_holders=[]))
        .order_by(F("idle_looked_at").asc(nulls_first=True), "pk")
        .values_list("pk", flat=True)[:limit]
    )
    TpuVm.objects.filter(pk__in=chosen).update(idle_looked_at=now)
    for vm_id in chosen:
        report.looked_at += 1
        look_at_vm(vm_id, now=now, report=report)
    IdleHolding.objects.filter(released_at__lt=now - SHOWN_AFTER_RELEASE).delete()
    return report


def look_at_vm(vm_id: int, *, now: dt.datetime | None = None, report: PassReport | None = None):
    """Follow the holdings of one VM from its stored samples (see the module's doc)."""
    now = now or timezone.now()
    report = report or PassReport()
    vm = TpuVm.objects.select_related("lab").filter(pk=vm_id).first()
    if vm is None or not vm.lab.idle_policy_enabled:
        return report
    lab = vm.lab
    holds = holdings_of(vm)
    keys = {h.key for h in holds}
    rows = {_key(r): r for r in IdleHolding.objects.filter(vm=vm)}
    gone = [r.pk for k, r in rows.items() if k not in keys and r.released_at is None]
    IdleHolding.objects.filter(pk__in=gone).delete()
    exempt = set(
        Membership.objects.filter(lab=lab, idle_exempt=True).values_list("user_id", flat=True)
    )
    samples = _samples(vm, now)
    threshold = float(Decimal(lab.idle_threshold_percent))
    for held in holds:
        row = rows.get(held.key)
        if row is not None and row.released_at is not None:
            continue  # the policy acted once; what is left is the person's to end
        if vm.idle_exempt or (held.person_id is not None and held.person_id in exempt):
            if row is not None:
                row.delete()
            continue
        since, used, busy_at = _idle_since(held, samples, threshold)
        if row is not None and row.idle_since is not None and busy_at is not None:
            if busy_at >= row.idle_since:  # busy since, whether or not it still is
                _busy_again(row, lab, report)
                row.idle_since = row.warned_at = row.admins_told_at = None
        if since is None:
            continue
        if held.job is not None and held.job.started_at and since < held.job.started_at:
            since = held.job.started_at
        if row is None:
            try:
                with transaction.atomic():
                    row = IdleHolding.objects.create(
                        vm=vm, job=held.job, worker=held.worker, pid=held.pid,
                        start=held.start, person_id=held.person_id, unix_user=held.unix_user,
                        command=held.command[:200], chips=sorted(held.chips), hbm_used=used,
                        idle_since=since,
                    )  # fmt: skip
            except IntegrityError:
                continue  # a pass that overlaps this one follows it; the next run takes it
        else:
            row.chips, row.hbm_used = sorted(held.chips), used
            row.idle_since = row.idle_since or since
            row.save(update_fields=["chips", "hbm_used", "idle_since"])
        _step(row, lab, now, report)
    return report


def holdings_of(vm: TpuVm) -> list[Held]:
    """What holds the VM's chips now: its running job (every chip), and each process
    outside the portal in the last look, with the chips it has open."""
    every = {
        (int(w["worker"]), int(c["chip"]))
        for w in vm.chip_metrics or []
        for c in w.get("chips", [])
    }
    holds = [
        Held(job=job, person_id=job.user_id, chips=set(every))
        for job in Job.objects.filter(vm=vm, state=JobState.RUNNING)
    ]
    outside: dict[tuple, Held] = {}
    for h in vm.outside_holders or []:
        try:
            worker, pid = int(h.get("worker")), int(h.get("pid"))
        except (TypeError, ValueError):
            continue
        start = int(h["start"]) if str(h.get("start", "")).isdigit() else None
        held = outside.setdefault(
            (worker, pid, start),
            Held(worker=worker, pid=pid, start=start, unix_user=str(h.get("user", "")),
                 command=str(h.get("command", ""))),
        )  # fmt: skip
        number = _NUMBER.search(str(h.get("device", "")))
        if number:
            held.chips.add((worker, int(number[1])))
    if outside:
        people = dict(
            UnixAccount.objects.filter(
                username__in={h.unix_user for h in outside.values()}, username__gt=""
            ).values_list("username", "user_id")
        )
        for held in outside.values():
            held.person_id = people.get(held.unix_user)
    return holds + list(outside.values())


def _key(row: IdleHolding) -> tuple:
    return ("job", row.job_id) if row.job_id else ("process", row.worker, row.pid, row.start)


def _samples(vm: TpuVm, now) -> list[tuple[dt.datetime, dict]]:
    """The VM's kept samples, by time, oldest first: (at, {(worker, chip): (duty, used)})."""
    by_time: dict[dt.datetime, dict] = {}
    for s in ChipSample.objects.filter(vm=vm, at__gte=now - _kept()).order_by("at"):
        by_time.setdefault(s.at, {})[(s.worker, s.chip)] = (s.duty, s.hbm_used)
    return sorted(by_time.items())


def _idle_since(held: Held, samples, threshold: float):
    """Since when every chip of ``held`` stayed below ``threshold`` (None when its last
    sample is busy), the HBM its chips used at their last sample (None: no sample has
    them), and the time of its last busy sample (None: none kept)."""
    since, used, busy_at = None, None, None
    for at, chips in samples:
        mine = [chips[c] for c in held.chips if c in chips]
        if not mine:
            continue
        used = sum(u for _, u in mine)
        if all(duty < threshold for duty, _ in mine):
            since = since or at
        else:
            since, busy_at = None, at
    return since, used, busy_at


def _minutes(n: int) -> dt.timedelta:
    return dt.timedelta(minutes=n)


def _step(row: IdleHolding, lab: Lab, now, report: PassReport) -> None:
    """The one next step due for an idle holding, if any."""
    if row.warned_at is None:
        if now - row.idle_since >= _minutes(lab.idle_warn_minutes):
            _warn(row, lab, now, report)
        return
    if row.admins_told_at is None:
        if now - row.warned_at >= _minutes(lab.idle_admins_minutes):
            _tell_admins(row, lab, now, report)
        else:
            return
    if lab.idle_release and row.released_at is None:
        release(row, now=now, report=report)


def _claim(row: IdleHolding, field_name: str, now) -> bool:
    """Take one step at most once, whoever runs the pass: a conditional update."""
    claimed = IdleHolding.objects.filter(pk=row.pk, **{f"{field_name}__isnull": True}).update(
        **{field_name: now}
    )
    setattr(row, field_name, now)
    return bool(claimed)


def _record(row: IdleHolding, lab: Lab, action: AuditAction, summary: str, **data) -> None:
    audit.record(
        action,
        lab=lab,
        target_user=row.person,
        summary=f"{row.what} on {row.vm.name}: {summary}"[:300],
        data={"vm": row.vm_id, "job": row.job_id, "pid": row.pid, "worker": row.worker,
              "idle_since": row.idle_since.isoformat(), **data},
    )  # fmt: skip


def _warn(row: IdleHolding, lab: Lab, now, report: PassReport) -> None:
    with transaction.atomic():
        if not _claim(row, "warned_at", now):
            return
        _record(row, lab, AuditAction.IDLE_WARNED, f"idle since {row.idle_since:%H:%M}")
        emails.send_idle_email(row.pk, "warned")
    report.warned.append(row.pk)


def _tell_admins(row: IdleHolding, lab: Lab, now, report: PassReport) -> None:
    with transaction.atomic():
        if not _claim(row, "admins_told_at", now):
            return
        _record(row, lab, AuditAction.IDLE_ADMINS_TOLD, f"idle since {row.idle_since:%H:%M}")
        emails.send_idle_email(row.pk, "admins")
    report.admins_told.append(row.pk)


def _busy_again(row: IdleHolding, lab: Lab, report: PassReport) -> None:
    """The chips are in use again: the holding starts over."""
    with transaction.atomic():
        told = row.warned_at is not None
        IdleHolding.objects.filter(pk=row.pk).update(
            idle_since=None, warned_at=None, admins_told_at=None
        )
        if told:
            _record(row, lab, AuditAction.IDLE_BUSY_AGAIN, "in use again")
    report.reset.append(row.pk)


def release(row: IdleHolding, *, now=None, report: PassReport | None = None) -> bool:
    """End an idle holding by the lab's policy: cancel the job, or stop the process
    (TERM, the grace period, KILL) through the remote door. True when it was ended (or
    was already gone); a worker that cannot be reached leaves it for the next pass."""
    now = now or timezone.now()
    row = IdleHolding.objects.select_related("vm__lab", "job", "person").get(pk=row.pk)
    lab = row.vm.lab
    if row.released_at is not None:
        return True
    if row.job is not None:
        reason = (
            f"Released by {lab.name}'s policy on idle chips: idle since "
            f"{timezone.localtime(row.idle_since):%H:%M}."
        )
        with transaction.atomic():
            cancel_job(row.job, None, reason=reason)
            return _released(row, lab, now, f"cancelled job {row.job_id}", report)
    outcome = _stop_process(row)
    if outcome is None:
        return False
    with transaction.atomic():
        # The process is gone from the VM's holders now; the queue may have the TPU.
        vm = TpuVm.objects.select_for_update().get(pk=row.vm_id)
        left = [
            h
            for h in vm.outside_holders or []
            if (str(h.get("worker")), str(h.get("pid"))) != (str(row.worker), str(row.pid))
        ]
        TpuVm.objects.filter(pk=vm.pk).update(outside_holders=left)
        queue.advance_jobs(vm.pk)
        done = _released(row, lab, now, outcome, report)
    scheduler.place(lab.pk)
    return done


def _stop_process(row: IdleHolding) -> str | None:
    """holder-stop.sh on the process's worker: what it did, or None (not reachable)."""
    if row.start is None:
        _note(row, "not released: its start time is unknown, so it cannot be told apart")
        return None
    worker = row.vm.workers.filter(index=row.worker).first()
    if worker is None:
        _note(row, f"not released: the VM has no worker {row.worker}")
        return None
    _, glob = chip_layout(row.vm, row.vm.workers.count())
    data = wire.encode_holder_stop(
        row.pid, row.start, glob, settings.PORTAL_IDLE_RELEASE_GRACE_SECONDS
    )
    try:
        result = run_script(remote_worker(worker, login_for(row.vm.lab)), "holder-stop.sh", data)
        how, alive = wire.parse_holder_stop(result.values)
    except (RemoteError, ValueError) as exc:
        _note(row, f"not released yet: {exc}")
        log.warning("idle holding %s: cannot stop it: %s", row.pk, exc)
        return None
    return {
        "term": "ended with TERM",
        "kill": "ended with KILL after the grace period" + (" (it still runs)" if alive else ""),
        "gone": "it had ended already",
        "other": "it had ended already (its pid is another process's now)",
        "released": "it no longer held a chip",
    }[how]


def _note(row: IdleHolding, outcome: str) -> None:
    IdleHolding.objects.filter(pk=row.pk).update(outcome=outcome[:300])
    row.outcome = outcome[:300]


def _released(row: IdleHolding, lab: Lab, now, outcome: str, report) -> bool:
    if not _claim(row, "released_at", now):
        return True
    _note(row, outcome)
    _record(row, lab, AuditAction.IDLE_RELEASED, outcome)
    emails.send_idle_email(row.pk, "released")
    if report is not None:
        report.released.append(row.pk)
    return True


# --- what the VM's page shows -----------------------------------------------------------


def state_text(row: IdleHolding) -> str:
    """The holding's steps in words: "idle since 14:02, told 14:32; released at 15:02
    by the lab's policy"."""

    def at(when) -> str:
        return f"{timezone.localtime(when):%H:%M}"

    words = [f"idle since {at(row.idle_since)}"] if row.idle_since else []
    if row.warned_at:
        words.append(f"told {at(row.warned_at)}")
    if row.admins_told_at:
        words.append(f"admins told {at(row.admins_told_at)}")
    text = ", ".join(words)
    if row.released_at:
        text += f"; released at {at(row.released_at)} by the lab's policy"
    return text


def for_vm(vm: TpuVm) -> list[tuple[IdleHolding, str]]:
    """The VM's idle holdings with their state in words, for its page."""
    rows = IdleHolding.objects.filter(vm=vm).filter(
        Q(idle_since__isnull=False) | Q(released_at__isnull=False)
    )
    return [(row, state_text(row)) for row in rows]

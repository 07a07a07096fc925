"""Jobs on TPU VMs, as people ask for them: what a job is (``JobSpec``, checked by
``clean_spec``), who may run one, submit, run again, cancel.

The database holds what should run (``Job``, one FIFO queue per VM); ``job_engine``
makes the workers follow it. Nothing here talks to a worker: a cancel of a started job
is a row the VM's next pass acts on.
"""

from __future__ import annotations

import logging
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import DatabaseError, transaction
from django.dispatch import Signal
from django.utils import timezone

from portal import audit
from portal.audit import AuditAction
from tpus import queue
from tpus.models import Grant, Job, Lab, TpuVm
from tpus.models.grants import GrantState
from tpus.models.inventory import validate_accelerator_type
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState, Provisioning
from tpus.remote import jobs as wire
from tpus.services import elastic_pools, emails, scheduler, snapshots

log = logging.getLogger(__name__)
MAX_TIME_LIMIT_MINUTES = 7 * 24 * 60


# --- what a person asks for ----------------------------------------------------------


@dataclass
class JobSpec:
    """A job as the form or the API gives it. ``script`` and ``python`` may be given
    relative to the home (``train.py``, ``~/venv``); ``clean`` makes them absolute."""

    args: list[str] = field(default_factory=list)
    script: str = ""
    python: str = ""
    cwd: str = ""
    env: list[tuple[str, str]] = field(default_factory=list)
    time_limit_minutes: int | None = None
    notify: bool = False
    use_tcmalloc: bool = True
    rerun_after_preemption: bool = False
    # The id of a workdir snapshot of the person's in the job's lab, placed at ``cwd``
    # on every worker before the command starts.
    snapshot: int | None = None
    # Set by ``of`` for a job whose snapshot expired since: it cannot run again.
    snapshot_gone: bool = False

    @classmethod
    def of(cls, job: Job) -> JobSpec:
        return cls(
            args=list(job.args),
            script=job.script,
            python=job.python,
            cwd=job.cwd,
            env=[(name, value) for name, value in job.env],
            time_limit_minutes=job.time_limit_minutes,
            notify=job.notify,
            rerun_after_preemption=job.rerun_after_preemption,
            use_tcmalloc=job.use_tcmalloc,
            snapshot=job.snapshot_id,
            snapshot_gone=bool(job.snapshot_digest and job.snapshot_id is None),
        )


def home_of(username: str) -> str:
    return f"/home/{username}"


def coordinator_of(first_worker) -> str:
    """Where a pod job's processes meet: jax.distributed's coordinator on worker 0, at
    its internal address (the one the other workers reach), as ``host:port``."""
    address = first_worker.internal_ip or first_worker.external_ip
    return f"{address}:{settings.PORTAL_JOB_COORDINATOR_PORT}"


def parse_command(text: str) -> list[str]:
    """A command line as a person types it, split like a shell would (quotes), but
    never run by one. Raises ValidationError with what is wrong."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValidationError(f"The command cannot be read: {exc}.") from None
    if not words:
        raise ValidationError("Give the command to run.")
    return words


def parse_env(text: str) -> list[tuple[str, str]]:
    """``NAME=value`` lines; blank lines and ``#`` comments are skipped."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            raise ValidationError(f"Line {number} is not NAME=value.")
        pairs.append((name.strip(), value))
    return pairs


def clean_spec(spec: JobSpec, username: str, snapshot=None) -> JobSpec:
    """The spec with paths made absolute, or ValidationError naming each bad field.
    The workers check everything again (the pre-flight and job-start.sh)."""
    errors: dict[str, list[str]] = {}
    home = home_of(username)

    def add(name: str, message: str) -> None:
        errors.setdefault(name, []).append(message)

    def in_home(name: str, value: str, what: str) -> str:
        value = value.strip()
        if not value:
            return ""
        if value == "~" or value.startswith("~/"):
            value = home + value[1:]
        elif not value.startswith("/"):
            value = f"{home}/{value}"
        path = PurePosixPath(value)
        if ".." in path.parts:
            add(name, f"The {what} may not contain '..'.")
        elif path != PurePosixPath(home) and PurePosixPath(home) not in path.parents:
            add(name, f"The {what} must be inside your home, {home}.")
        try:
            wire.check_path(str(path), f"the {what}")
        except ValueError as exc:
            add(name, _sentence(str(exc)))
        return str(path)

    script = in_home("script", spec.script, "script")
    python = in_home("python", spec.python, "Python environment")
    cwd = in_home("cwd", spec.cwd, "working directory")
    if snapshot is not None and not cwd:
        # A workdir sent without a place for it: a folder of its own, by its content.
        cwd = f"{home}/tpu-snapshots/{snapshot.digest[:16]}"
    if spec.snapshot_gone:
        add(
            "snapshot",
            "The workdir this job carried has expired; run it anew from your workdir "
            "(tpu run --workdir …).",
        )
    if script and PurePosixPath(script) == PurePosixPath(home):
        add("script", "The script is a file in your home, not the home itself.")
    args = [str(a) for a in spec.args]
    if not script and not args:
        add("args", "Give the command to run, or a script.")
    if len(args) > wire.MAX_ARGS:
        add("args", f"At most {wire.MAX_ARGS} arguments.")
    for arg in args:
        try:
            wire._text(arg, "an argument")
        except ValueError as exc:
            add("args", _sentence(str(exc)))
            break
    if not script and args and (not args[0] or "=" in args[0]):
        add(
            "args",
            "The command's first word is a program, not NAME=value (use the environment field).",
        )
    names = [name for name, _ in spec.env]
    if len(names) > wire.MAX_ENV:
        add("env", f"At most {wire.MAX_ENV} environment variables.")
    if len(set(names)) != len(names):
        add("env", "Each environment variable may be set once.")
    for name, value in spec.env:
        try:
            wire.check_env_name(name)
            wire._text(value, f"the value of {name}")
        except ValueError as exc:
            add("env", _sentence(str(exc)))
    limit = spec.time_limit_minutes
    if limit is not None and not 1 <= limit <= MAX_TIME_LIMIT_MINUTES:
        add("time_limit_minutes", f"A time limit is 1 to {MAX_TIME_LIMIT_MINUTES} minutes.")
    if errors:
        raise ValidationError(errors)
    return JobSpec(
        args=args,
        script=script,
        python=python,
        cwd=cwd,
        env=list(spec.env),
        time_limit_minutes=limit,
        notify=bool(spec.notify),
        rerun_after_preemption=bool(spec.rerun_after_preemption),
        use_tcmalloc=bool(spec.use_tcmalloc),
        snapshot=spec.snapshot,
    )


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


# --- who may run what ----------------------------------------------------------------


def may_run_jobs(user, vm: TpuVm) -> bool:
    """Jobs run as the person, so they need access in force on the VM."""
    return Grant.objects.filter(user=user, vm=vm, state=GrantState.ACTIVE).exists()


def state_runs_jobs(grant_state: str | None) -> bool:
    """``may_run_jobs`` for a page that has the state of the person's grant on the VM
    (None without one)."""
    return grant_state == GrantState.ACTIVE


def submit_job(
    user,
    vm: TpuVm,
    spec: JobSpec,
    *,
    rerun_of: Job | None = None,
    request=None,
    dry_run: bool = False,
) -> Job | None:
    """Queue a job on ``vm`` for ``user``. Raises PermissionDenied without active
    access, ValidationError for a bad spec or a full queue; nothing is stored then.
    With ``dry_run``, the same checks and nothing else: None when the job would be
    queued (a client asks before it copies the job's files to the workers)."""
    account = getattr(user, "unix_account", None)
    if account is None or not account.username:
        raise PermissionDenied("Choose a username first: jobs run as your account on the VM.")
    snapshot = _snapshot_for(user, vm.lab, spec)
    spec = clean_spec(spec, account.username, snapshot)
    with transaction.atomic():
        vm = TpuVm.objects.select_for_update().select_related("lab").get(pk=vm.pk)
        if not may_run_jobs(user, vm):
            raise PermissionDenied(
                f"You need active access to {vm.name} to run jobs on it; ask a lab admin."
            )
        if vm.is_missing:
            raise ValidationError(f"{vm.name} is no longer listed by Google Cloud.")
        check_waiting_limit(user, vm.lab)
        limit = vm.lab.max_queued_jobs
        waiting = Job.objects.filter(vm=vm, user=user, state__in=WAITING_STATES).count()
        if limit and waiting >= limit:
            raise ValidationError(
                f"You already have {waiting} job(s) waiting on {vm.name}; this lab allows "
                f"{limit}. Cancel one or wait for it to start."
            )
        if dry_run:
            return None
        job = Job.objects.create(
            vm=vm, lab=vm.lab, user=user, rerun_of=rerun_of, **_fields(spec, snapshot)
        )
        snapshots.needed(job.snapshot_id)
        audit.record(
            AuditAction.JOB_SUBMITTED,
            actor=user,
            lab=vm.lab,
            target_user=user,
            summary=f"job {job.pk} on {vm.name}: {job.command_text[:200]}",
            data={"job": job.pk, "vm": vm.pk},
            request=request,
        )
        queue.advance_jobs(vm.pk)
    return job


def _snapshot_for(user, lab: Lab, spec: JobSpec):
    """The spec's snapshot: the person's own in the lab (any other is a 404, like one
    that does not exist), or None."""
    if spec.snapshot is None:
        return None
    return snapshots.get_own_snapshot(user, lab, spec.snapshot)


def _fields(spec: JobSpec, snapshot=None) -> dict:
    """A cleaned spec as a job's fields."""
    return dict(
        snapshot=snapshot,
        snapshot_digest=snapshot.digest if snapshot is not None else "",
        host_id=_new_host_id(),
        script=spec.script,
        args=spec.args,
        python=spec.python,
        cwd=spec.cwd,
        env=[[name, value] for name, value in spec.env],
        time_limit_minutes=spec.time_limit_minutes,
        notify=spec.notify,
        rerun_after_preemption=spec.rerun_after_preemption,
        use_tcmalloc=spec.use_tcmalloc,
    )


@dataclass(frozen=True)
class Kind:
    """A kind of VM a job may ask for instead of one VM: "any free v4-8", optionally
    in some zones, on-demand or spot only."""

    accelerator_type: str
    zones: tuple[str, ...] = ()
    provisioning: str = Provisioning.ANY

    @classmethod
    def of(cls, job: Job) -> Kind:
        return cls(job.accelerator_type, tuple(job.zones), job.provisioning)


def clean_kind(kind: Kind, lab: Lab) -> Kind:
    """The kind with its zones in order and without repeats, or ValidationError naming
    each bad field."""
    errors: dict[str, list[str]] = {}
    accelerator_type = (kind.accelerator_type or "").strip()
    try:
        validate_accelerator_type(accelerator_type)
    except ValidationError:
        errors["accelerator_type"] = ["An accelerator type looks like v4-8, v4-32 or v5litepod-8."]
    zones = []
    for zone in kind.zones:
        zone = str(zone).strip()
        if not _ZONE.fullmatch(zone):
            errors.setdefault("zones", []).append(f"{zone[:60]!r} is not a zone name.")
        elif zone not in zones:
            zones.append(zone)
    if kind.provisioning not in Provisioning.values:
        errors["provisioning"] = ["Provisioning is one of: " + ", ".join(Provisioning.values) + "."]
    if errors:
        raise ValidationError(errors)
    return Kind(accelerator_type, tuple(sorted(zones)), kind.provisioning)


def vms_of_kind(user, lab: Lab, kind: Kind):
    """The lab's VMs of the kind on which the person has access in force."""
    vms = TpuVm.objects.filter(
        lab=lab,
        accelerator_type=kind.accelerator_type,
        missing_since__isnull=True,
        grants__user=user,
        grants__state=GrantState.ACTIVE,
    )
    if kind.zones:
        vms = vms.filter(zone__in=kind.zones)
    if kind.provisioning == Provisioning.SPOT:
        vms = vms.filter(preemptible=True)
    elif kind.provisioning == Provisioning.ON_DEMAND:
        vms = vms.filter(preemptible=False)
    return vms


def submit_pool_job(
    user,
    lab: Lab,
    kind: Kind,
    spec: JobSpec,
    *,
    rerun_of: Job | None = None,
    moved_why: str = "",
    request=None,
    dry_run: bool = False,
) -> Job | None:
    """Queue a job on any free VM of ``kind`` in ``lab`` (the pool): it waits without
    a VM until the scheduler gives it one it may run on, then runs as a job of that VM.
    The same checks as ``submit_job``, with access on at least one VM of the kind
    instead of on one VM; the lab's limit of waiting jobs counts per kind. With
    ``dry_run``, the checks alone (None). With ``moved_why`` ("preempted"), the job
    ``rerun_of`` was lost with its VM and this is its next run: it goes to the head of
    the kind's line (see ``run_again_after_preemption``)."""
    account = getattr(user, "unix_account", None)
    if account is None or not account.username:
        raise PermissionDenied("Choose a username first: jobs run as your account on the VM.")
    kind = clean_kind(kind, lab)
    snapshot = _snapshot_for(user, lab, spec)
    spec = clean_spec(spec, account.username, snapshot)
    what = _kind_words(kind)
    with transaction.atomic():
        lab = Lab.objects.select_for_update().get(pk=lab.pk)
        # Read only when the person has no VM of the kind; the pool's look reuses it.
        elastic = None
        if not vms_of_kind(user, lab, kind).exists():
            elastic = elastic_pools.switched_on(lab, kind.accelerator_type)
            if elastic is None or not elastic.grows_for(user, kind.zones, kind.provisioning):
                raise PermissionDenied(
                    f"You have active access to no {what} of {lab.name}, so no job of yours "
                    "can run on one; ask a lab admin."
                )
        check_waiting_limit(user, lab, locked=True)
        limit = lab.max_queued_jobs
        waiting = Job.objects.filter(
            lab=lab,
            vm__isnull=True,
            user=user,
            accelerator_type=kind.accelerator_type,
            state__in=WAITING_STATES,
        ).count()
        if limit and waiting >= limit:
            raise ValidationError(
                f"You already have {waiting} job(s) waiting for a {kind.accelerator_type}; "
                f"this lab allows {limit}. Cancel one or wait for it to start."
            )
        if dry_run:
            return None
        job = Job.objects.create(
            vm=None,
            lab=lab,
            user=user,
            accelerator_type=kind.accelerator_type,
            zones=list(kind.zones),
            provisioning=kind.provisioning,
            rerun_of=rerun_of,
            **_fields(spec, snapshot),
            **(_move_fields(rerun_of, moved_why, what) if moved_why else {}),
        )
        snapshots.needed(job.snapshot_id)
        summary = f"job {job.pk} on any {what}: {job.command_text[:200]}"
        if moved_why:
            summary = (
                f"job {job.pk} on any {what}, run {job.attempt} of job {rerun_of.pk} after "
                f"{job.moved_from} was {moved_why}: {job.command_text[:200]}"
            )
        audit.record(
            AuditAction.JOB_SUBMITTED,
            actor=None if moved_why else user,
            lab=lab,
            target_user=user,
            summary=summary,
            data={"job": job.pk, "accelerator_type": kind.accelerator_type},
            request=request,
        )
        # A free VM of the kind takes it at once: its pass is queued with the commit.
        # (With no VM of the kind the person may use, none can: the pool is asked.)
        placed = [] if elastic is not None else scheduler.place(lab.pk, kind.accelerator_type)
        if not any(p.job_id == job.pk for p in placed):
            # None free: the kind's elastic pool, if on, asks for one now (the lab's row
            # is locked already), and its request is sent with this commit.
            _grow_pool(lab, kind.accelerator_type, None if elastic is None else elastic.granted)
    return job


# Sent in a pool job's submit that no free VM of its kind took, inside the submit's
# transaction (the lab's row locked), with ``lab_id`` and ``accelerator_type``, the
# ``lab`` as locked, and ``granted``, the people with a kind grant in force on the
# type when the submit read them (None: it did not): the kind's elastic pool answers
# it (``elastic_pass.no_vm_took``, connected at start by tpus.apps; the pool's module
# reaches this one through the VMs' lifecycle and requests, so this one does not
# import it).
no_vm_took = Signal()


def _grow_pool(lab: Lab, accelerator_type: str, granted: set[int] | None) -> None:
    """The kind's elastic pool looks at the jobs no VM takes, in the submit's
    transaction. A look that fails does not fail the submit: it is undone alone and
    left to the pool's own task, queued with the commit."""
    try:
        with transaction.atomic():
            no_vm_took.send(
                sender=Job,
                lab_id=lab.pk,
                accelerator_type=accelerator_type,
                lab=lab,
                granted=granted,
            )
    except DatabaseError:
        log.exception("the %s elastic pool's look at a submit failed", accelerator_type)
        queue.check_elastic_pool(lab.pk, accelerator_type)


def _move_fields(lost: Job, why: str, what: str) -> dict:
    """The fields of a pool job's next run after ``lost`` was lost with its VM: one
    more attempt, where from and why, at the head of its kind's line (as early as the
    lost run was queued, and back now)."""
    now = timezone.now()
    return dict(
        attempt=lost.attempt + 1,
        moved_from=lost.vm.name,
        moved_why=why,
        returned_at=now,
        queued_at=lost.queued_at,
        changed_at=now,
        reason=f"{lost.vm.name} was {why}; waiting at the head of the line for another {what}.",
    )


def check_waiting_limit(user, lab: Lab, *, locked: bool = False) -> None:
    """Refuse a job past the lab's limit of jobs one person may have waiting at once
    (for one VM or for any of a kind): ValidationError with the numbers. In the
    submit's transaction, with the lab's row locked (``locked``: already), so two
    submits at once cannot both pass it."""
    limit = lab.max_waiting_jobs_per_person
    if not limit:
        return
    if not locked:
        Lab.objects.select_for_update().filter(pk=lab.pk).exists()
    waiting = Job.objects.filter(lab=lab, user=user, state__in=WAITING_STATES).count()
    if waiting >= limit:
        raise ValidationError(
            f"You already have {waiting} job{'s' if waiting != 1 else ''} waiting in "
            f"{lab.name}; this lab allows {limit} waiting at once per person. Cancel one or "
            "wait for one to start."
        )


def _kind_words(kind: Kind) -> str:
    words = kind.accelerator_type
    if kind.zones:
        words += " in " + ", ".join(kind.zones)
    if kind.provisioning == Provisioning.SPOT:
        words += " (spot)"
    elif kind.provisioning == Provisioning.ON_DEMAND:
        words += " (on-demand)"
    return words


_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")


def rerun_job(user, job: Job, *, request=None) -> Job:
    """The same job again, at the end of the queue (of its VM, or of its kind)."""
    if job.user_id != user.pk:
        raise PermissionDenied("Only the person who submitted a job can run it again.")
    if not job.has_ended:
        raise ValidationError("The job has not ended yet.")
    if job.is_pool_job:
        lab = job.lab or job.vm.lab
        return submit_pool_job(
            user, lab, Kind.of(job), JobSpec.of(job), rerun_of=job, request=request
        )
    return submit_job(user, job.vm, JobSpec.of(job), rerun_of=job, request=request)


def cancel_job(job: Job, by, *, reason: str = "", request=None) -> Job:
    """Cancel a waiting job at once, or ask the VM's pass to stop a begun one: it is
    ``cancelling`` until the pass ends it. A job being validated never starts (the pass
    looks for the cancel before it says start, and whenever the job would go back in
    line); a started one gets TERM, a grace period, KILL on every worker."""
    with transaction.atomic():
        job = (
            Job.objects.select_for_update(of=("self",))
            .select_related("vm__lab", "lab")
            .get(pk=job.pk)
        )
        if not job.can_cancel:
            return job
        now = timezone.now()
        job.cancel_requested_at = job.cancel_requested_at or now
        job.cancelled_by = by
        job.changed_at = now
        if reason:
            job.reason = reason
        if job.is_waiting:
            job.state = JobState.CANCELLED
            job.ended_at = now
            job.reason = reason or "Cancelled before it started."
        elif job.state in (JobState.VALIDATING, JobState.STARTING, JobState.RUNNING):
            job.state = JobState.CANCELLING
        job.save()
        audit.record(
            AuditAction.JOB_CANCEL_REQUESTED,
            actor=by,
            lab=job.vm.lab if job.vm_id else job.lab,
            target_user=job.user,
            summary=f"job {job.pk} on {job.where_text}" + (f": {reason}" if reason else ""),
            data={"job": job.pk, "vm": job.vm_id},
            request=request,
        )
        if job.vm_id is not None:
            queue.advance_jobs(job.vm_id)
    return job


def cancel_jobs_of(user, vm: TpuVm, reason: str) -> int:
    """A revoked grant ends the person's jobs on the VM (waiting and running)."""
    jobs = Job.objects.filter(
        vm=vm, user=user, state__in=[*WAITING_STATES, *ACTIVE_STATES]
    ).exclude(state=JobState.CANCELLING)
    count = 0
    for job in jobs:
        cancel_job(job, None, reason=reason)
        count += 1
    return count


def _new_host_id() -> str:
    return f"{timezone.now():%Y%m%d}-{secrets.token_hex(6)}"


# A job submitted to a kind and lost with its VM is moved to another VM of the kind at
# most this many times: lost once more, it stays lost (its owner is told why), so a job
# that keeps losing its VMs does not go round for ever. Its first run is attempt 1.
MAX_MOVES = 3


def lost_because(vm: TpuVm) -> str:
    """What happened to the VM a job was lost with, in a few words: "preempted",
    "under maintenance", "deleted" ("tpu7 was …")."""
    if vm.is_missing or vm.state == TpuVm.State.DELETING:
        return "deleted"
    if vm.state == TpuVm.State.REPAIRING:
        return "under maintenance"
    if vm.state in (TpuVm.State.PREEMPTED, TpuVm.State.READY, TpuVm.State.CREATING):
        # Back already, or being made anew: Google took it back.
        return "preempted"
    return vm.get_state_display().lower()


def run_again_after_preemption(job: Job) -> Job | None:
    """A job lost because Google took its VM back (preempted, under maintenance,
    deleted), whose owner asked for it: the same job again. One named for its VM goes
    to the head of that VM's line (queued as early as the lost one was), to start once
    the VM is back. One submitted to a kind goes to the head of its kind's line (ahead
    of fair share) for the next free VM of it, not only the one it lost, at most
    ``MAX_MOVES`` times; its owner hears where it went when it is placed
    (``scheduler.place``), or, when it is not run again, that it was lost. None when it
    was not asked for or cannot be queued now (the person lost access, the lab's limit
    of waiting jobs, the cap)."""
    job = Job.objects.select_related("vm__lab", "user__unix_account").get(pk=job.pk)
    if not job.rerun_after_preemption or job.state != JobState.LOST:
        return None
    if Job.objects.filter(rerun_of=job).exists():
        return None
    if not job.is_pool_job:
        try:
            again = submit_job(job.user, job.vm, JobSpec.of(job), rerun_of=job)
        except (PermissionDenied, ValidationError) as exc:
            log.info("job %s is not run again after the preemption: %s", job.pk, exc)
            return None
        Job.objects.filter(pk=again.pk).update(
            queued_at=job.queued_at,
            attempt=job.attempt + 1,
            reason=f"Run again after {job.vm.name} was preempted.",
        )
        return again
    if job.attempt > MAX_MOVES:
        _not_moved(
            job,
            f"It was moved to another {job.accelerator_type} {MAX_MOVES} times already, so it "
            "is not run again.",
        )
        return None
    try:
        return submit_pool_job(
            job.user,
            job.lab or job.vm.lab,
            Kind.of(job),
            JobSpec.of(job),
            rerun_of=job,
            moved_why=lost_because(job.vm),
        )
    except (PermissionDenied, ValidationError) as exc:
        text = " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        _not_moved(job, f"It is not run again: {text}")
        return None


def _not_moved(job: Job, why: str) -> None:
    """A lost pool job that is not run again: its reason says why, and its owner hears
    that it was lost (the email it would have had without "run again")."""
    log.info("job %s is not run again after its VM was lost: %s", job.pk, why)
    if why not in job.reason:
        # Asked again when the VM is back (``keep_alive``): said once.
        Job.objects.filter(pk=job.pk).update(reason=f"{job.reason} {why}".strip())
    emails.send_job_email(job.pk)

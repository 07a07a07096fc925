"""The pass engine of jobs: validate, start on every worker, follow, stop, end.

The database holds what should run (``Job``, one FIFO queue per VM); one pass at a
time per VM (``advance``, claimed like a reconcile and renewed by a heartbeat) makes
the workers follow it through the remote door with the four shipped scripts
(``job-preflight.sh``, ``job-start.sh``, ``job-status.sh``, ``job-cancel.sh``; see
docs/jobs-host.md). The portal learns how a job goes only by asking the workers (one
``job-status.sh`` exec per worker per pass), never from a call by the VM.

A pass: poll the VM's active job (log bytes, exits, reboots); stop what must stop (a
cancel, a failed or lost worker of a pod, the time limit); once the VM's place is free,
take the next job in line, run the pre-flight on every worker at once, and start it
on every worker at once, in the same exec per worker (each waits for the word to
start once every worker passed). So the next job starts in the same pass that saw the
last one end, over the connections that pass already made.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from dataclasses import dataclass, field

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from portal.audit import AuditAction
from tpus import queue
from tpus.models import Job, JobWorker, Snapshot, TpuVm
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState, JobWorkerState, first_failed
from tpus.remote import Held, HostKeyMismatch, Sessions, WorkerOutcome
from tpus.remote import jobs as wire
from tpus.services import (
    chip_metrics,
    disk_mounts,
    emails,
    leases,
    made_anew,
    scheduler,
    snapshots,
)
from tpus.services.hosts import remote_worker
from tpus.services.jobs import coordinator_of, may_run_jobs, run_again_after_preemption
from tpus.services.labkeys import login_for
from tpus.services.leases import Heartbeat

log = logging.getLogger(__name__)

# Node states in which a job cannot be running: its processes went with the VM.
GONE_STATES = {
    TpuVm.State.STOPPED,
    TpuVm.State.STOPPING,
    TpuVm.State.PREEMPTED,
    TpuVm.State.TERMINATED,
    TpuVm.State.REPAIRING,
    TpuVm.State.RESTARTING,
    TpuVm.State.REIMAGING,
    TpuVm.State.DELETING,
}
# Node states in which the machines are gone for good (Google took them back): the
# job's processes went with them, and asking the workers would only wait out the
# connect timeout before the job could end and run again elsewhere.
TAKEN_STATES = {TpuVm.State.PREEMPTED, TpuVm.State.TERMINATED}
# Checks that fail because something outside the portal holds the TPU: the job waits
# (``blocked``) instead of being refused.
HELD_CHECKS = {"chip_holder", "libtpu_lockfile", "portal_lock"}
# What a job needs in the person's home: gone with a VM made anew after a preemption.
HOME_CHECKS = {"python", "script"}
# A pass that dies while validating a job leaves it in ``validating``; the next pass
# puts it back in line, at most this many times, then refuses it with the reason.
MAX_INTERRUPTED_VALIDATIONS = 3
# What to do about a refusal, by check: said once after the reason.
HINTS = {
    "script": "Copy your code to every worker, or keep it on a data disk.",
    "python": "Make the environment on every worker, or keep it on a data disk.",
}

# --- the VM's pass -------------------------------------------------------------------


@dataclass
class PassReport:
    vm_id: int
    busy: bool = False
    started: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    polled: int = 0


def vms_with_jobs() -> list[int]:
    """The VMs the job poll visits: a job holds their place, or one waits in line (a
    pool job waiting without a VM has none to visit: placement gives it one)."""
    return list(
        Job.objects.filter(state__in=[*ACTIVE_STATES, *WAITING_STATES], vm__isnull=False)
        .values_list("vm_id", flat=True)
        .distinct()
        .order_by("vm_id")
    )


def poll_all() -> None:
    """Queue a pass for every VM with a job running or waiting (the periodic poll),
    after giving free VMs to the pool's waiting jobs (which queues their passes)."""
    scheduler.place_all()
    for vm_id in vms_with_jobs():
        queue.advance_jobs(vm_id)


def _claim(vm_id: int) -> bool:
    """Hold the VM for one pass (which looks at everything: no pass is wanted after)."""
    now = timezone.now()
    return bool(
        TpuVm.objects.filter(pk=vm_id)
        .filter(Q(jobs_claimed_until__isnull=True) | Q(jobs_claimed_until__lt=now))
        .update(jobs_claimed_until=now + leases.length(), jobs_pass_wanted=False)
    )


def _claim_or_ask(vm_id: int) -> bool:
    """Hold the VM for one pass, or ask the pass holding it to pass again when it ends
    (what changed meanwhile, a job submitted, is then seen at once). The second try
    covers a holder that ended between the first and the asking."""
    if _claim(vm_id):
        return True
    TpuVm.objects.filter(pk=vm_id).update(jobs_pass_wanted=True)
    return _claim(vm_id)


def _release(vm_id: int) -> None:
    TpuVm.objects.filter(pk=vm_id).update(jobs_claimed_until=None)
    if TpuVm.objects.filter(pk=vm_id, jobs_pass_wanted=True).update(jobs_pass_wanted=False):
        queue.advance_jobs(vm_id)


def advance(vm_id: int, *, max_steps: int = 20) -> PassReport:
    """One pass over a VM's jobs (see the module's text). Another pass holding the VM
    means this one does nothing: that pass sees the same rows."""
    report = PassReport(vm_id)
    if not _claim_or_ask(vm_id):
        report.busy = True
        return report
    connections = _PassConnections()
    try:
        with Heartbeat(TpuVm.objects.filter(pk=vm_id), "jobs_claimed_until", "job pass"):
            for _ in range(max_steps):
                if not _step(vm_id, report, connections):
                    break
    finally:
        connections.close()
        _release(vm_id)
    return report


def _step(vm_id: int, report: PassReport, connections: _PassConnections) -> bool:
    """Do the next thing; True when another step may have something to do at once."""
    job = Job.objects.filter(vm_id=vm_id, state__in=ACTIVE_STATES).select_related("vm").first()
    if job is None:
        head = _head_of_line(vm_id)
        if head is None and _placed_here(vm_id):
            head = _head_of_line(vm_id)
        if head is None:
            return False
        return _begin(head, report, connections)
    if job.state in (JobState.VALIDATING, JobState.STARTING):
        # A pass that died between its steps (its claim lapsed): finish its work.
        return _recover(job, report, connections)
    report.polled += 1
    return _poll(job, report, connections)


def _head_of_line(vm_id: int) -> Job | None:
    """The VM's next job, with its owner and their account (who may run it, as whom)."""
    return (
        Job.objects.filter(vm_id=vm_id, state__in=WAITING_STATES)
        .select_related("user__unix_account")
        .order_by("queued_at", "id")
        .first()
    )


def _placed_here(vm_id: int) -> bool:
    """The VM's place is free and no job waits for it by name: the pool's waiting jobs
    of its kind get the lab's free VMs now (this one among them, for this pass to
    start; the others' passes are queued). True when one was placed here."""
    vm = TpuVm.objects.filter(pk=vm_id).values("lab_id", "accelerator_type").first()
    if vm is None or not vm["accelerator_type"]:
        return False
    placed = scheduler.place(vm["lab_id"], vm["accelerator_type"], in_pass_of=vm_id)
    return any(p.vm_id == vm_id for p in placed)


def _vm_and_workers(vm_id: int):
    vm = TpuVm.objects.select_related("lab").get(pk=vm_id)
    workers = list(vm.workers.order_by("index"))
    return vm, workers


def _unready(vm: TpuVm, workers) -> str:
    """Why jobs cannot start on the VM now (they wait), or ''."""
    if vm.is_missing:
        return f"{vm.name} is no longer listed by Google Cloud."
    if vm.state in GONE_STATES or vm.state in (TpuVm.State.CREATING, TpuVm.State.STARTING):
        return f"{vm.name} is {vm.get_state_display().lower()}."
    if not workers:
        return f"{vm.name} has no workers yet."
    if vm.restore_version is not None:
        return f"{vm.name} is back on new machines and is being set up again."
    for worker in workers:
        if not worker.is_pinned:
            return f"Worker {worker.index} ({worker.alias}) has no confirmed host keys."
        if not worker.external_ip:
            return f"Worker {worker.index} ({worker.alias}) has no address."
        # An alarm about published keys only does not stop the worker: the pinned key
        # still guards every connection. A key the worker presented differently does.
        if worker.host_key_mismatch_at and not worker.host_key_alarm_published:
            return f"Worker {worker.index} ({worker.alias}) presented another host key."
    return ""


def chip_layout(vm: TpuVm, workers: int) -> tuple[int, str]:
    """(chips per worker, device glob) for the VM's accelerator type. v2, v3, v4 and
    v5p names count TensorCores (two per chip); v5e (v5litepod) and v6e names count
    chips. ``PORTAL_JOB_DEVICE_GLOBS`` maps a generation to where its chips appear."""
    match = re.fullmatch(r"(v[0-9]+[a-z]*?)(litepod)?-([0-9]+)", vm.accelerator_type or "")
    globs = settings.PORTAL_JOB_DEVICE_GLOBS
    if not match:
        return settings.PORTAL_JOB_DEFAULT_CHIPS_PER_WORKER, globs.get("*", "/dev/accel*")
    generation = match[1] + (match[2] or "")
    chips = scheduler.chip_count(vm.accelerator_type)
    per_worker = max(1, chips // max(1, workers))
    return per_worker, globs.get(generation, globs.get("*", "/dev/accel*"))


class _Hosts:
    """A VM's workers through the remote door for one pass: one connection each, kept
    for every step of the pass (pre-flight then start; status, stop, status)."""

    def __init__(self, vm: TpuVm, workers):
        login = login_for(vm.lab)
        self.vm = vm
        self.workers = list(workers)
        self.remote = [remote_worker(w, login) for w in self.workers]
        self.model = {id(r): w for r, w in zip(self.remote, self.workers, strict=True)}
        self.sessions = Sessions(self.remote)

    def __enter__(self) -> _Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.sessions.__exit__(*exc)

    def run(self, script: str, data, *, only=None) -> list[WorkerOutcome]:
        """``data``: bytes, or a function of the (model) worker. Outcomes in the order
        of ``only`` (default: every worker)."""
        chosen = self.workers if only is None else list(only)
        remote = [r for w in chosen for r in self.remote if self.model[id(r)] is w]
        return self._seen(self.sessions.run(script, self.payload(data), only=remote))

    def begin(self, first: str, data, then: str, *, then_data=None, give_up=None) -> Held:
        """``first`` on every worker, each held until ``go`` runs ``then`` (give it
        ``payload(data)``) or the ``with`` block is left without it. ``then_data`` and
        ``give_up``: see ``Sessions.begin``."""
        early = None if then_data is None else self.payload(then_data)
        held = self.sessions.begin(
            first, self.payload(data), then, then_data=early, give_up=give_up
        )
        self._seen(held.first)
        return held

    def _seen(self, outcomes: list[WorkerOutcome]) -> list[WorkerOutcome]:
        """A worker that presented another host key may be a new machine of a node
        Google made anew: asked of the API (one GetNode), and then re-pinned with the
        VM set up again; its jobs went with the old machines."""
        if any(isinstance(o.error, HostKeyMismatch) for o in outcomes if not o.ok):
            made_anew.recognise(self.vm)
        return outcomes

    def payload(self, data):
        """Data for the door: a function of the model worker, of the remote one."""
        return (lambda r: data(self.model[id(r)])) if callable(data) else data


class _PassConnections:
    """One pass's connections to its VM's workers: made by the first step that needs
    them and kept for the pass's next steps, so the pass that sees a job end starts the
    next one in line without logging in again. Closed when the pass ends (never kept
    between passes); a step that finds other workers, addresses, host keys or another
    login connects anew."""

    def __init__(self) -> None:
        self.hosts: _Hosts | None = None

    def to(self, vm: TpuVm, workers) -> _Hosts:
        fresh = _Hosts(vm, workers)
        if self.hosts is not None and self.hosts.remote == fresh.remote:
            fresh.__exit__(None, None, None)
            # The same workers as this step's rows, so callers' objects match.
            self.hosts.workers = fresh.workers
            self.hosts.model = {
                id(r): w for r, w in zip(self.hosts.remote, fresh.workers, strict=True)
            }
            return self.hosts
        self.close()
        self.hosts = fresh
        return fresh

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.__exit__(None, None, None)
            self.hosts = None


def _begin(job: Job, report: PassReport, connections: _PassConnections) -> bool:
    vm, workers = _vm_and_workers(job.vm_id)
    reason = _unready(vm, workers)
    if reason:
        _wait(job, f"Waiting: {reason}")
        return False
    hosts = connections.to(vm, workers)
    return _validate_and_start(job, vm, workers, hosts, report)


# What a job's begin changes (the rest of it, its pre-flight rows among them, stays).
_BEGUN_FIELDS = ("state", "worker_count", "begun_at", "changed_at", "reason")


def _validate_and_start(job: Job, vm: TpuVm, workers, hosts: _Hosts, report: PassReport) -> bool:
    if not may_run_jobs(job.user, vm):
        _end(job, JobState.CANCELLED, "Your access to the VM ended before the job started.")
        report.ended.append(job.pk)
        return True
    with transaction.atomic():
        locked = Job.objects.select_for_update(of=("self",)).select_related("user__unix_account")
        job = locked.get(pk=job.pk)
        if job.state not in WAITING_STATES:
            return True
        job.state = JobState.VALIDATING
        job.worker_count = len(workers)
        job.begun_at = timezone.now()
        job.changed_at = job.begun_at
        job.reason = ""
        try:
            with transaction.atomic():
                job.save(update_fields=[*_BEGUN_FIELDS])
        except IntegrityError:  # another job holds the VM's place after all
            return False
        job.parts.all().delete()
        JobWorker.objects.bulk_create(JobWorker(job=job, worker=w, index=w.index) for w in workers)
    username = job.user.unix_account.username
    chips, glob = chip_layout(vm, len(workers))
    pod = len(workers) > 1
    port = settings.PORTAL_JOB_COORDINATOR_PORT
    env_names = tuple(name for name, _ in job.env)
    carried = _Carried.of(job)
    if carried is None and job.snapshot_digest:
        _end(job, JobState.FAILED, "Its workdir snapshot was removed before it could start.")
        report.ended.append(job.pk)
        return True
    # A script among the snapshot's files is not there before it is placed: the
    # placement, after the pre-flight, puts it (the same on every worker).
    script = job.script
    if carried is not None and carried.names(script):
        script = ""

    def preflight(worker) -> bytes:
        return wire.encode_preflight(
            wire.Preflight(
                user=username,
                chips=chips,
                device_glob=glob,
                min_disk_mb=settings.PORTAL_JOB_MIN_DISK_MB,
                min_mem_mb=settings.PORTAL_JOB_MIN_MEM_MB,
                coordinator_port=port if pod and worker.index == 0 else None,
                python=job.python,
                script=script,
                env_names=env_names,
                probe_seconds=settings.PORTAL_JOB_PREFLIGHT_PROBE_SECONDS,
                snapshot_blobs=carried.blobs if carried is not None else (),
            )
        )

    def cancelled() -> bool:
        return Job.objects.filter(pk=job.pk, cancel_requested_at__isnull=False).exists()

    # The pre-flight and the start are one exec per worker: each worker answers its
    # checks, makes the job's cgroup and folder, and waits; only when every worker
    # passed does each get the word to start. Leaving this block otherwise (a failed
    # check, a cancel, an error) stops them all, and each removes what it made; a
    # cancel while workers still check stops waiting for them at once.
    start = _start_input(job, vm, workers, username)
    with hosts.begin(
        "job-preflight.sh", preflight, "job-start.sh", then_data=start, give_up=cancelled
    ) as held:
        return _judge_and_start(job, vm, workers, hosts, held, report, carried)


class _Carried:
    """The workdir snapshot a job carries, as its pass needs it: its files and its
    contents, each once with its size."""

    def __init__(self, job: Job, files: list):
        self.owner_id = job.user_id
        self.directory = job.cwd
        self.files = tuple((f.path, f.mode, f.sha256) for f in files)
        self.blobs = tuple(sorted({(f.sha256, f.size) for f in files}))
        self.sizes = dict(self.blobs)

    @classmethod
    def of(cls, job: Job) -> _Carried | None:
        if job.snapshot_id is None:
            return None
        snapshot = Snapshot.objects.filter(pk=job.snapshot_id).first()
        if snapshot is None:
            return None
        return cls(job, snapshots.files_of(snapshot))

    def names(self, path: str) -> bool:
        """Whether ``path`` (absolute) is one of its files placed at the job's folder."""
        prefix = self.directory.rstrip("/") + "/"
        return (
            bool(path)
            and path.startswith(prefix)
            and any(f[0] == path[len(prefix) :] for f in self.files)
        )

    def stream(self, username: str, lacking: set[str]):
        """snapshot-place.sh's input for one worker: the header, then each content the
        worker's cache lacks, read from the storage a chunk at a time."""
        blobs = tuple((sha, size) for sha, size in self.blobs if sha in lacking)
        yield wire.encode_place(wire.Place(username, self.directory, self.files, blobs))
        for sha, size in blobs:
            yield f"{sha} {size}\n".encode()
            with snapshots.open_blob(self.owner_id, sha) as blob:
                while chunk := blob.read(snapshots.CHUNK):
                    yield chunk


def _place_snapshot(
    job: Job, carried: _Carried, workers, hosts: _Hosts, lacking: dict[int, set[str]]
) -> tuple[list[str], bool]:
    """The job's workdir on every worker (each held after its pre-flight), before any
    starts: one snapshot-place.sh exec per worker, beside the held one, sending only
    the contents that worker's cache lacks. (problems per worker, whether they were
    all connections that failed)."""
    username = job.user.unix_account.username

    def data(worker):
        return carried.stream(username, lacking.get(worker.index, set()))

    outcomes = hosts.run("snapshot-place.sh", data)
    problems, unreachable = [], 0
    for worker, outcome in zip(workers, outcomes, strict=True):
        if outcome.ok:
            said = outcome.result.values
            # With the pre-flight's rows: what this worker was sent and wrote.
            job.preflight.setdefault(str(worker.index), []).append([
                "snapshot_place", "ok",
                f"{said.get('placed', '?')} file(s) written, {said.get('kept', '?')} already "
                f"there, {said.get('received', '?')} content(s) received",
            ])  # fmt: skip
            continue
        problems.append(f"worker {worker.index} ({worker.alias}): {outcome.error}")
        unreachable += bool(outcome.error.retryable and not outcome.error.script_ran_late)
    return problems, bool(problems) and unreachable == len(problems)


def _judge_and_start(
    job: Job, vm: TpuVm, workers, hosts: _Hosts, held: Held, report, carried=None
) -> bool:
    alias = workers_by_index(workers)
    reports, rows, failures, unreachable = {}, {}, [], []
    lacking: dict[int, set[str]] = {}
    for worker, outcome in zip(workers, held.first, strict=True):
        problem = _preflight_problem(outcome)
        if not problem:
            try:
                reports[worker.index] = wire.parse_preflight(outcome.result.all("check"))
                lacking[worker.index] = wire.parse_missing(outcome.result.all("snapshot_missing"))
            except ValueError as exc:
                problem = f"its answer cannot be read ({exc})"
        elif outcome.error.retryable and not outcome.error.script_ran_late:
            unreachable.append((worker, outcome))
        if problem:
            rows[worker.index] = [["preflight", "fail", problem]]
            failures.append((worker.index, "preflight", problem))
    judged = _judge(reports, workers)
    failures += judged
    holders = _holders(reports)
    rows.update(_rows(reports, judged))
    job.preflight = {str(i): rows[i] for i in sorted(rows)}
    if failures:
        _set_holders(vm, holders)
        # A cancel asked for while the workers ran their checks: nothing starts. (The
        # workers that had not answered were cut off by it: only the others' rows
        # stay.) Where every worker passed, the start's own look below covers it.
        if _ended_by_cancel(job, {str(i): rows[i] for i in sorted(reports)}, report):
            return True
    if unreachable and len(unreachable) == len(failures):
        # Only workers that could not be reached: wait for them.
        worker, outcome = unreachable[0]
        text = f"worker {worker.index} ({worker.alias}): {outcome.error}"
        return _back_in_line(job, f"Waiting: cannot reach {text}", report=report)
    if failures:
        text = _refusal_text(failures, alias, len(workers))
        if all(name in HELD_CHECKS for _, name, _ in failures):
            return _back_in_line(
                job, f"The TPU is in use outside the portal: {text}", blocked=True, report=report
            )
        until = _home_wait_until(job, vm)
        if until and all(name in HOME_CHECKS for _, name, _ in failures):
            return _back_in_line(
                job,
                f"Waiting for what it needs in your home on {vm.name}, which is new since "
                f"the preemption: {text} It starts once that is there again (rejected if "
                f"still missing at {until:%H:%M} UTC).",
                report=report,
            )
        _reject(job, f"The pre-flight failed on {text}", report)
        return True
    if carried is not None:
        problems, only_unreachable = _place_snapshot(job, carried, workers, hosts, lacking)
        if only_unreachable:
            return _back_in_line(job, f"Waiting: cannot reach {problems[0]}", report=report)
        if problems:
            # Leaving the held block stops every worker: nothing starts anywhere.
            Job.objects.filter(pk=job.pk).update(preflight=job.preflight)
            _end(job, JobState.FAILED, "Its workdir could not be placed on " + "; ".join(problems))
            report.ended.append(job.pk)
            return True
        snapshots.needed(job.snapshot_id)
    # Every worker waits for the word: one transaction records what they found (and
    # that the job is starting, before the word goes out) unless a cancel came.
    with transaction.atomic():
        current = Job.objects.select_for_update().get(pk=job.pk)
        if current.cancel_requested_at and not current.has_ended:
            cancelled = True
        else:
            cancelled = False
            _set_holders(vm, holders)
            current.state = JobState.STARTING
            current.preflight = job.preflight
            current.changed_at = timezone.now()
            current.save(update_fields=["state", "preflight", "changed_at"])
    if cancelled:
        _set_holders(vm, holders)
        return _ended_by_cancel(current, job.preflight, report)
    current.user = job.user  # loaded with the account before the pre-flight
    return _start(current, vm, workers, reports, report, hosts, held)


def _home_wait_until(job: Job, vm: TpuVm) -> dt.datetime | None:
    """A job run again after Google took its VM back meets a home made anew: until
    when it may wait there for the person to put back what it needs (their
    environment, their script), or None when it does not wait."""
    if not job.rerun_of_id or vm.restored_at is None:
        return None
    lost_at = (
        Job.objects.filter(pk=job.rerun_of_id, state=JobState.LOST)
        .values_list("ended_at", flat=True)
        .first()
    )
    until = vm.restored_at + dt.timedelta(seconds=settings.PORTAL_JOB_RERUN_HOME_WAIT_SECONDS)
    if lost_at is None or lost_at > vm.restored_at or timezone.now() >= until:
        return None
    return until


def _preflight_problem(outcome: WorkerOutcome) -> str:
    """Why a worker gave no pre-flight answer (its check is ``preflight``), or ''."""
    if outcome.ok:
        return ""
    error = outcome.error
    if error.script_ran_late:
        return f"it did not finish within {settings.PORTAL_REMOTE_SCRIPT_TIMEOUT} s"
    return error.message


def _rows(reports: dict[int, wire.PreflightReport], judged) -> dict[int, list[list[str]]]:
    """Each worker's checks as rows, with what the portal judged itself (versions
    against jax's pins, the script the same everywhere) made the check's own ``fail``."""
    rows = {i: [[c.name, c.status, c.detail] for c in r.checks] for i, r in reports.items()}
    problems: dict[tuple[int, str], list[str]] = {}
    for index, name, detail in judged:
        if [name, "fail", detail] not in rows.get(index, []):
            problems.setdefault((index, name), []).append(detail)
    for (index, name), details in problems.items():
        lines = rows.setdefault(index, [])
        text = "; ".join(details)
        row = next((r for r in lines if r[0] == name and r[1] == "ok"), None)
        if row is not None:
            row[1], row[2] = "fail", f"{text} ({row[2]})" if row[2] else text
        else:
            lines.append([name, "fail", text])
    return rows


def _refusal_text(failures, alias, worker_count: int) -> str:
    """The failed checks for people: one refusal found the same on every worker is said
    once, and a hint for what to do follows when there is one."""
    groups: dict[tuple[str, str], list[int]] = {}
    for index, name, detail in failures:
        where = groups.setdefault((name, detail), [])
        if index not in where:
            where.append(index)
    parts = []
    for (name, detail), indexes in groups.items():
        if worker_count > 1 and len(indexes) == worker_count:
            where = f"every worker ({worker_count})"
        else:
            where = ", ".join(f"worker {i} ({alias[i].alias})" for i in sorted(indexes))
        parts.append(f"{where}: {name}: {detail}")
    hints = []
    for name, detail in groups:
        hint = HINTS.get(name)
        if hint and hint not in hints and _hint_fits(name, detail):
            hints.append(hint)
    text = "; ".join(parts)
    text = text if text.endswith(".") else text + "."
    return " ".join([text, *hints])


def _hint_fits(name: str, detail: str) -> bool:
    if name == "script":
        return "does not exist" in detail or "differs" in detail
    return name == "python" and "is not there" in detail


def _ended_by_cancel(job: Job, preflight: dict, report: PassReport) -> bool:
    """End the job as cancelled if a cancel was asked for while it was being validated
    (True); the pre-flight's rows stay with it."""
    with transaction.atomic():
        current = Job.objects.select_for_update().get(pk=job.pk)
        if not current.cancel_requested_at or current.has_ended:
            return False
        if preflight:
            current.preflight = preflight
            current.save(update_fields=["preflight"])
    _end(current, JobState.CANCELLED, current.reason or "Cancelled before it started.")
    report.ended.append(job.pk)
    return True


def _reject(job: Job, reason: str, report: PassReport) -> None:
    """Refused by the pre-flight: the reason, and every worker's checks as rows."""
    Job.objects.filter(pk=job.pk).update(preflight=job.preflight)
    _end(job, JobState.REJECTED, reason)
    report.ended.append(job.pk)


def workers_by_index(workers) -> dict:
    return {w.index: w for w in workers}


def _judge(reports: dict[int, wire.PreflightReport], workers) -> list[tuple[int, str, str]]:
    """Every failed check as (worker index, check, detail), with what the portal
    judges itself: versions against jax's pins, the script the same on every worker."""
    failures = []
    for index, report in reports.items():
        failures += [(index, c.name, c.detail) for c in report.failures]
        if report.detail("python") and not any(c.name == "python" for c in report.failures):
            problems = wire.judge_versions(
                report.versions, need_libtpu=settings.PORTAL_JOB_REQUIRE_LIBTPU
            )
            failures += [(index, "python", p) for p in problems]
    if len(reports) > 1 and all(r.script_sha256 for r in reports.values()):
        by_index = workers_by_index(workers)
        named = {by_index[i].alias: r for i, r in sorted(reports.items())}
        index_of = {by_index[i].alias: i for i in reports}
        for alias in wire.differing_scripts(named):
            failures.append((index_of[alias], "script", "differs from worker 0's copy"))
    return failures


def _holders(reports) -> list[dict]:
    """What the pre-flight found holding a chip: also the VM's "held outside" list."""
    holders = []
    for index, report in sorted(reports.items()):
        for check in report.checks:
            if check.name == "chip_holder" and check.status == "fail":
                holders.append({"worker": index, **_holder_fields(check.detail)})
    return holders


def _holder_fields(detail: str) -> dict:
    """``/dev/accel0 pid=123 user=ann command=python x.py`` as a dict."""
    device, _, rest = detail.partition(" ")
    fields = {"device": device, "pid": "", "user": "", "command": ""}
    match = re.match(r"pid=(\S*) user=(\S*) command=(.*)", rest)
    if match:
        fields.update(pid=match[1], user=match[2], command=match[3].strip())
    return fields


def _start_input(job: Job, vm: TpuVm, workers, username: str):
    """Each worker's input of job-start.sh, held until the word (``wire.encode_word``)."""
    coordinator = coordinator_of(workers[0])
    env = tuple((name, value) for name, value in job.env)
    limits = job_limits(vm.lab)
    ports = chip_metrics.ports()

    def start(worker) -> bytes:
        pod = wire.Pod(coordinator, len(workers), worker.index) if len(workers) > 1 else None
        return wire.encode_start(
            wire.StartJob(
                job_id=job.host_id,
                user=username,
                argv=tuple(job.argv),
                env=env,
                python=job.python,
                cwd=job.cwd,
                pod=pod,
                metrics_ports=ports,
                hold=True,
                **limits,
            )
        )

    return start


def _start(
    job: Job, vm: TpuVm, workers, reports, report: PassReport, hosts: _Hosts, held: Held
) -> bool:
    first = workers[0]
    # The word carries what the pre-flight found for the environment: the TCMalloc
    # library of worker 0, for every worker.
    late = []
    if job.use_tcmalloc and "LD_PRELOAD" not in {name for name, _ in job.env}:
        found = reports[first.index].detail("tcmalloc")
        if found.startswith("/"):
            late.append(("LD_PRELOAD", found.split()[0]))

    outcomes = held.go(wire.encode_word(late))
    problems, starts = [], []
    for worker, outcome in zip(workers, outcomes, strict=True):
        answer = _start_answer(outcome)
        if isinstance(answer, str):
            problems.append(f"worker {worker.index} ({worker.alias}): {answer}")
            starts.append((worker.index, JobWorkerState.NOT_STARTED, answer, None, None, None))
        else:
            started_at = None
            if answer.started_at:
                started_at = dt.datetime.fromtimestamp(answer.started_at, tz=dt.UTC)
            boot_id = answer.boot_id or None
            starts.append(
                (worker.index, JobWorkerState.RUNNING, None, answer.pid, boot_id, started_at)
            )
    # The workers' answers and the job's running state commit together: the API says
    # running as soon as every worker's process is up, with their pids. (Nothing of
    # the job is read again but whether a cancel came: the pass has the rest.)
    with transaction.atomic():
        cancel_requested_at = (
            Job.objects.select_for_update()
            .filter(pk=job.pk)
            .values_list("cancel_requested_at", flat=True)
            .get()
        )
        _record_starts(job, starts)
        if not problems:
            now = timezone.now()
            job.started_at = now
            job.changed_at = now
            job.cancel_requested_at = cancel_requested_at
            job.state = JobState.CANCELLING if cancel_requested_at else JobState.RUNNING
            job.save(update_fields=["state", "started_at", "changed_at"])
            audit.record(
                AuditAction.JOB_STARTED,
                lab=vm.lab,
                target_user=job.user,
                summary=f"job {job.pk} on {vm.name}, {len(workers)} worker(s)",
                data={"job": job.pk, "vm": vm.pk},
            )
    if problems:
        _stop_parts(job, hosts, grace=0)
        _end(job, JobState.FAILED, "It could not start on " + "; ".join(problems))
        report.ended.append(job.pk)
        return True
    report.started.append(job.pk)
    return job.state == JobState.CANCELLING


# One part's start (``_record_starts``): what is not given (NULL) keeps the part's.
_RECORD_START = (
    "UPDATE {table} SET state = %s, error = COALESCE(%s, error), pid = COALESCE(%s, pid), "
    "boot_id = COALESCE(%s, boot_id), started_at = COALESCE(%s, started_at) "
    'WHERE job_id = %s AND "index" = %s'
)


def _record_starts(job: Job, starts) -> None:
    """Each worker's part as the start round left it, from ``(index, state, error,
    pid, boot id, started at)`` (None keeps the part's): one statement per part, sent
    together (one round trip with PostgreSQL's pipeline). ``bulk_update`` would build
    a CASE per field and part, which cost a 32-worker pod's pass 30-50 ms of CPU
    before the job could say it runs."""
    table = connection.ops.quote_name(JobWorker._meta.db_table)
    when = JobWorker._meta.get_field("started_at")
    rows = [
        (state, error, pid, boot_id, when.get_db_prep_value(started_at, connection), job.pk, index)
        for index, state, error, pid, boot_id, started_at in starts
    ]
    with connection.cursor() as cursor:
        cursor.executemany(_RECORD_START.format(table=table), rows)


def job_limits(lab) -> dict:
    """What each worker's cgroup of a job of ``lab`` allows, and how long the worker
    keeps the folders of ended jobs (``StartJob``'s fields)."""
    return {
        "tasks_max": lab.job_tasks_max,
        "memory_max_mb": lab.job_memory_max_mb,
        "log_max_bytes": lab.job_log_max_mb * 1024 * 1024,
        "keep_days": settings.PORTAL_JOB_FOLDER_RETENTION_DAYS,
    }


def _start_answer(outcome: WorkerOutcome):
    if not outcome.ok:
        return str(outcome.error)
    try:
        answer = wire.parse_start(outcome.result.values)
    except (ValueError, KeyError) as exc:
        return f"unreadable answer ({exc})"
    if answer.outcome == "refused":
        if answer.reason.startswith("busy"):
            return f"the TPU is held by another job ({answer.reason[5:]})"
        return f"refused ({answer.reason})"
    return answer


def _recover(job: Job, report: PassReport, connections: _PassConnections) -> bool:
    """A job left in validating or starting by a pass that died."""
    if job.state == JobState.VALIDATING:
        # Nothing started (the start is recorded before the word to start is sent):
        # back in line, unless the pre-flight was cut short too often already.
        tries = job.interrupted_validations + 1
        Job.objects.filter(pk=job.pk).update(interrupted_validations=tries)
        if tries >= MAX_INTERRUPTED_VALIDATIONS:
            _reject(
                job,
                f"The pre-flight was cut short {tries} times (the portal's pass stopped "
                "while it ran), so it is not tried again. Run the job again; if this "
                "happens again, tell the lab's admins.",
                report,
            )
            return True
        _back_in_line(
            job,
            "Waiting: the last pre-flight was cut short (the portal's pass stopped while "
            f"it ran); trying again ({tries} of {MAX_INTERRUPTED_VALIDATIONS - 1}).",
            report=report,
        )
        return True
    _poll(job, report, connections, recovering=True)
    return True


def _poll(
    job: Job, report: PassReport, connections: _PassConnections, *, recovering: bool = False
) -> bool:
    """Ask every worker how the job goes (one exec each), record it, and decide."""
    vm, workers = _vm_and_workers(job.vm_id)
    hosts = connections.to(vm, workers)
    return _follow(job, vm, workers, hosts, report, recovering)


def _follow(job: Job, vm: TpuVm, workers, hosts: _Hosts, report: PassReport, recovering: bool):
    parts = {p.index: p for p in job.parts.all()}
    if vm.state in TAKEN_STATES:
        # (A VM no longer listed is still asked: a listing may be wrong for a while,
        # and its processes are stopped if they are there.)
        statuses = False
        _gone_with(job, vm)
    else:
        statuses = _status_round(job, vm, hosts, parts)
    # The round can take long with workers gone: decide on what the VM is now.
    vm.refresh_from_db()
    job.refresh_from_db()
    parts = {p.index: p for p in job.parts.all()}
    live = [p for p in parts.values() if p.state == JobWorkerState.RUNNING]
    alias = workers_by_index(workers)
    now = timezone.now()

    lost = [p for p in parts.values() if p.state == JobWorkerState.LOST]
    failed = first_failed(parts.values(), now)
    outcome, reason = None, ""
    # The lab's admins stop or delete the VM: its jobs were cancelled first, and the
    # call waits for them (``vm_lifecycle.jobs_still_stopping``): the machines are
    # still there, and the job is stopped like any cancel, not lost with them.
    stopped_for_it = job.cancel_requested_at and vm.state in (
        TpuVm.State.STOPPING,
        TpuVm.State.DELETING,
    )
    taken_back = not stopped_for_it and (vm.state in GONE_STATES or _made_anew_under(job, vm))
    if stopped_for_it:
        outcome = JobState.CANCELLED
    elif vm.state in GONE_STATES:
        outcome = JobState.LOST
        reason = f"{vm.name} was {vm.get_state_display().lower()} while the job ran."
    elif taken_back:
        outcome = JobState.LOST
        reason = f"Google Cloud took {vm.name} back while the job ran; it was made anew."
    elif vm.is_missing:
        outcome = JobState.LOST
        reason = f"{vm.name} is no longer listed by Google Cloud (deleted?) while the job ran."
    elif lost:
        p = lost[0]
        outcome = JobState.LOST
        reason = f"Worker {p.index} ({alias[p.index].alias}) rebooted or lost the job's process."
    elif job.cancel_requested_at:
        outcome = JobState.CANCELLED
    elif failed is not None:
        p = failed
        outcome = JobState.FAILED
        reason = f"Worker {p.index} ({alias[p.index].alias}) {p.outcome}" + (
            "; the other workers were stopped." if len(parts) > 1 else "."
        )
    elif recovering and not all(p.state != JobWorkerState.PENDING for p in parts.values()):
        outcome = JobState.FAILED
        reason = "The portal stopped while starting the job; it was stopped on every worker."
    elif (
        job.time_limit_minutes
        and job.started_at
        and now - job.started_at > dt.timedelta(minutes=job.time_limit_minutes)
    ):
        outcome = JobState.FAILED
        reason = f"It ran past its time limit of {job.time_limit_minutes} minute(s)."
    elif not live and parts and all(p.state == JobWorkerState.ENDED for p in parts.values()):
        outcome = JobState.SUCCEEDED

    if outcome is None:
        if recovering and job.state == JobState.STARTING:
            Job.objects.filter(pk=job.pk).update(
                state=JobState.RUNNING, started_at=job.started_at or now, changed_at=now
            )
        return False
    if (live or lost) and statuses:
        grace = 0 if outcome == JobState.LOST else settings.PORTAL_JOB_CANCEL_GRACE_SECONDS
        _stop_parts(job, hosts, grace=grace)
        _status_round(job, vm, hosts, {p.index: p for p in job.parts.all()})
    if outcome == JobState.CANCELLED:
        job.refresh_from_db()
        reason = job.reason or "Cancelled."
    # A pool job lost with its VM whose owner asked to run it again moves to another
    # VM of its kind: they hear once, where it went (or, when it does not move, that
    # it was lost), not first that it was lost.
    with_its_vm = outcome == JobState.LOST and (taken_back or vm.is_missing)
    moving = with_its_vm and job.is_pool_job and job.rerun_after_preemption
    _end(job, outcome, reason, tell=not moving)
    if with_its_vm:
        run_again_after_preemption(job)
    report.ended.append(job.pk)
    return True


def _gone_with(job: Job, vm: TpuVm) -> None:
    """The job's running parts went with the VM's machines (no worker is asked)."""
    gone = vm.get_state_display().lower()
    job.parts.filter(state=JobWorkerState.RUNNING).update(
        state=JobWorkerState.LOST, error=f"{vm.name} is {gone}: the process went with it"
    )


def _made_anew_under(job: Job, vm: TpuVm) -> bool:
    """Whether the VM came back on new machines after the job began (Google took it
    back and the keep-alive brought it back before this pass looked): its workers are
    not those the job ran on. Jobs wait while a VM is set up again, so one that began
    did so before."""
    began = job.begun_at or job.started_at
    if vm.restore_version is not None:
        return began is not None
    return bool(began and vm.restored_at and vm.restored_at > began)


def _status_round(job: Job, vm: TpuVm, hosts: _Hosts, parts) -> bool:
    """One job-status.sh exec per worker; records state, exit and new log bytes.
    False when no worker could be asked."""
    workers = hosts.workers
    tail_bytes = settings.PORTAL_JOB_LOG_TAIL_BYTES

    def status(worker) -> bytes:
        part = parts.get(worker.index)
        offset = part.log_offset if part is not None else 0
        # The worker skips ahead when more is new than the page keeps: the end counts.
        return wire.encode_status(
            {job.host_id: offset}, max_bytes=tail_bytes, device_glob=glob, tail=True,
            metrics_ports=asked,
        )  # fmt: skip

    _, glob = chip_layout(vm, len(workers))
    asked = chip_metrics.ports_to_ask(vm)

    outcomes = hosts.run("job-status.sh", status)
    answered = False
    holders: list[dict] | None = []
    metrics = chip_metrics.answers(workers, outcomes) if asked else {}
    with transaction.atomic():
        for worker, outcome in zip(workers, outcomes, strict=True):
            part = JobWorker.objects.select_for_update().filter(job=job, index=worker.index).first()
            if part is None:
                continue
            if not outcome.ok:
                part.error = str(outcome.error)
                part.save(update_fields=["error"])
                holders = None
                continue
            try:
                status = wire.parse_status(outcome.result.pairs)
            except ValueError as exc:
                part.error = f"unreadable status: {exc}"
                part.save(update_fields=["error"])
                holders = None
                continue
            answered = True
            _apply_status(part, status.jobs.get(job.host_id), status.boot_id)
            disk_mounts.boot_seen(worker, status.boot_id)  # a reboot: mounts checked again
            if holders is not None:
                holders += _outside(worker.index, status.holders, own_group=part.pid)
        if holders is not None:
            _set_holders(vm, holders)
        chip_metrics.record(vm, metrics)
    return answered


def _outside(index: int, found, *, own_group: int | None = None) -> list[dict]:
    """The chip holders that are not the portal's: not in a portal job's cgroup (even
    one that left the job's process group), nor in the job's group (its pid)."""
    return [
        {
            "worker": index,
            "device": h.device,
            "pid": str(h.pid),
            "start": "" if h.start is None else str(h.start),
            "user": h.user,
            "command": h.command,
        }
        for h in found
        if not h.job and (own_group is None or h.pgid != own_group)
    ]


def _set_holders(vm: TpuVm, holders: list[dict]) -> None:
    TpuVm.objects.filter(pk=vm.pk).update(outside_holders=holders, usage_checked_at=timezone.now())


def check_usage(vm_id: int) -> list[dict] | None:
    """Who holds the VM's chips now, from one job-status.sh exec per worker; stored on
    the VM. None when a worker could not be asked (the last answer stays). When the
    portal asks is ``services.holders``'s business."""
    vm, workers = _vm_and_workers(vm_id)
    if _unready(vm, workers):
        return None
    _, glob = chip_layout(vm, len(workers))
    asked = chip_metrics.ports_to_ask(vm)
    running = {
        p.index: p.pid
        for p in JobWorker.objects.filter(
            job__vm=vm, job__state__in=ACTIVE_STATES, state=JobWorkerState.RUNNING
        )
    }
    with _Hosts(vm, workers) as hosts:
        outcomes = hosts.run(
            "job-status.sh",
            wire.encode_status({}, max_bytes=0, device_glob=glob, metrics_ports=asked),
        )
    if asked:
        chip_metrics.record(vm, chip_metrics.answers(workers, outcomes))
    holders = []
    for worker, outcome in zip(workers, outcomes, strict=True):
        if not outcome.ok:
            return None
        status = wire.parse_status(outcome.result.pairs)
        disk_mounts.boot_seen(worker, status.boot_id)  # an idle VM's reboot is seen here
        holders += _outside(worker.index, status.holders, own_group=running.get(worker.index))
    _set_holders(vm, holders)
    return holders


def _apply_status(part: JobWorker, state: wire.JobState | None, boot_id: str) -> None:
    part.error = ""
    if state is None or state.state == "unknown":
        if part.state == JobWorkerState.RUNNING:
            part.state = JobWorkerState.LOST
            part.error = "the worker has no record of the job"
    else:
        if state.log:
            text = state.log.decode("utf-8", "replace")
            if state.log_offset > part.log_offset and part.log_tail:
                part.log_tail += "\n[… skipped …]\n"
            keep = settings.PORTAL_JOB_LOG_TAIL_BYTES
            part.log_tail = (part.log_tail + text)[-keep:]
            part.log_offset = state.log_offset + len(state.log)
        part.log_size = state.log_size
        if state.pid:
            part.pid = state.pid
        if state.state == "running":
            part.state = JobWorkerState.RUNNING
        elif state.state == "ended":
            part.state = JobWorkerState.ENDED
            part.exit_status = state.exit_status
            part.signal = state.signal
            if state.ended_at:
                part.ended_at = dt.datetime.fromtimestamp(state.ended_at, tz=dt.UTC)
        elif state.state == "lost":
            part.state = JobWorkerState.LOST
            part.error = (
                "the worker rebooted"
                if state.boot_id and boot_id and state.boot_id != boot_id
                else "the job's supervisor is gone"
            )
    part.save()


def stop_on_workers(job: Job, *, grace: int = 0) -> None:
    """Stop the job's processes on every worker now (TERM, ``grace``, KILL), whatever
    the database says; the next pass records the end."""
    vm, workers = _vm_and_workers(job.vm_id)
    with _Hosts(vm, workers) as hosts:
        _stop_parts(job, hosts, grace=grace)


def _stop_parts(job: Job, hosts: _Hosts, *, grace: int) -> None:
    """TERM, up to the grace period, KILL on every worker still running the job, and
    on those where it was lost (its supervisor gone, processes may be left in its
    cgroup; of an earlier boot, nothing is signalled): each worker answers once the
    job's cgroup there is empty."""
    running = set(
        job.parts.filter(
            state__in=[JobWorkerState.RUNNING, JobWorkerState.PENDING, JobWorkerState.LOST]
        ).values_list("index", flat=True)
    )
    chosen = [w for w in hosts.workers if w.index in running]
    if not chosen:
        return
    outcomes = hosts.run("job-cancel.sh", wire.encode_cancel(job.host_id, grace), only=chosen)
    for worker, outcome in zip(chosen, outcomes, strict=True):
        if not outcome.ok:
            log.warning("job %s: cannot stop it on %s: %s", job.pk, worker.alias, outcome.error)
        elif not wire.cancel_emptied(outcome.result.values):
            log.warning("job %s: processes stay in its cgroup on %s", job.pk, worker.alias)


def _wait(job: Job, reason: str) -> None:
    if job.reason != reason:
        Job.objects.filter(pk=job.pk, state__in=WAITING_STATES).update(
            reason=reason, changed_at=timezone.now()
        )


def _back_in_line(
    job: Job, reason: str, *, blocked: bool = False, report: PassReport | None = None
) -> bool:
    """The job waits at the head of the queue again (the next pass tries again), or
    ends as cancelled if a cancel was asked for meanwhile. True when it ended."""
    with transaction.atomic():
        current = Job.objects.select_for_update().get(pk=job.pk)
        if not current.cancel_requested_at:
            Job.objects.filter(pk=job.pk).update(
                state=JobState.BLOCKED if blocked else JobState.QUEUED,
                reason=reason,
                preflight=job.preflight,
                changed_at=timezone.now(),
            )
            return False
    return _ended_by_cancel(job, job.preflight, report or PassReport(job.vm_id))


def _end(job: Job, state: JobState, reason: str, *, tell: bool = True) -> None:
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("vm__lab").get(pk=job.pk)
        if job.has_ended:
            return
        now = timezone.now()
        job.state = state
        job.reason = reason
        job.ended_at = now
        job.changed_at = now
        job.save()
        job.parts.filter(state=JobWorkerState.PENDING).update(state=JobWorkerState.NOT_STARTED)
        audit.record(
            AuditAction.JOB_ENDED,
            lab=job.vm.lab,
            target_user=job.user,
            summary=f"job {job.pk} on {job.vm.name}: {state.label.lower()}"
            + (f" ({reason[:200]})" if reason else ""),
            data={"job": job.pk, "vm": job.vm_id, "state": state.value},
        )
        if tell and (job.notify or state == JobState.LOST):
            # In the outbox with the job's end, in one transaction: no task to lose.
            emails.send_job_email(job.pk)

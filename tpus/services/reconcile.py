"""Making a TPU VM's workers match the database: one script run per worker, all
workers in parallel, one reconcile per VM at a time.

The database says who should exist on the VM (grants), with which keys, sudo and
disks; ``reconcile.sh`` makes each worker so and says what it changed. Afterwards
grants whose change every worker has applied are settled (active or revoked), and
the people concerned are emailed.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import re
import secrets
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.db.models import Q
from django.utils import timezone

from accounts.unix import mark_names_provisioned
from portal import audit, outbox
from portal.metrics import histograms
from portal.metrics.histograms import RECONCILE_DURATION, REVOKE_DURATION
from tpus import queue
from tpus.models import (
    AuditAction,
    ConnectionState,
    Grant,
    Job,
    Membership,
    TpuVm,
    VmConnection,
    Worker,
    WorkerSync,
)
from tpus.models.grants import WANTED_STATES, GrantState
from tpus.models.jobs import JobState
from tpus.models.labs import MembershipState
from tpus.remote import HostKeyMismatch, RemoteError, run_on_workers
from tpus.remote.desired import DesiredState, DesiredUser, encode
from tpus.services import (
    connect,
    disk_mounts,
    emails,
    job_engine,
    leases,
    made_anew,
    scheduler,
)
from tpus.services.hostkey_alarms import raise_alarm
from tpus.services.hosts import remote_worker
from tpus.services.labkeys import login_for
from tpus.services.leases import Heartbeat

log = logging.getLogger(__name__)


# Failures not tried again by themselves: no change on the host mends them (the
# worker's host key, its pin, its address), or the fix reconciles anyway (the lab's
# key refused: connecting the VM reconciles it once every worker takes the key). Any
# other failure of a worker (the portal's account lost sudo there, a script refused)
# is tried again with a back-off, so it heals soon after the fix.
NOT_MENDED_ON_THE_HOST = {
    RemoteError.HOST_KEY,
    RemoteError.NO_PIN,
    RemoteError.NOT_ALLOWED,
    RemoteError.AUTH,
}


# How soon a run whose workers refused the lab's key while the VM is still taking it
# (the guest agent applies it within seconds of boot, often a tenth of a second after a
# new VM shows up) is tried again the first time; the pause doubles with each retry.
KEY_RETRY_SECONDS = 0.1


@dataclass
class ReconcileReport:
    vm_id: int
    # Asked by the caller: the pool jobs its settle places on the VM start in the run.
    start_placed_jobs: bool = False
    version: int = 0
    busy: bool = False
    ok: list[int] = field(default_factory=list)  # worker indexes
    retryable: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    changed: int = 0
    # Workers refused the lab's key while the VM is still taking it: looked at again soon.
    waiting_for_key: bool = False
    # Pool jobs were placed on the VM as their owners' grants came in force; no pass was
    # queued for them: the run started them (``start_placed_jobs``) or its caller does.
    jobs_placed: bool = False
    # How long the run spent starting them (not counted in the reconcile's duration).
    jobs_start_seconds: float = 0.0
    # A worker refused the lab's key in the last run, which began at ``run_started``.
    refused: bool = False
    run_started: dt.datetime | None = None

    @property
    def complete(self) -> bool:
        return not self.busy and not self.retryable and not self.failed


def key_comment(key) -> str:
    """The comment the portal writes after each key: which key of the portal it is."""
    return f"tpu-portal-key-{key.pk}"


def desired_state(vm: TpuVm) -> DesiredState:
    """Everything the VM's workers must reflect, from the database."""
    grants = (
        Grant.objects.filter(vm=vm)
        .select_related("user__unix_account")
        .prefetch_related("user__ssh_keys")
        .order_by("user__unix_account__uid")
    )
    # Authorization is checked again here, whatever the grant rows say: only an active
    # person who is still an approved member, within the grant's and the lab's dates,
    # can log in.
    members = set(
        Membership.objects.filter(lab_id=vm.lab_id, state=MembershipState.APPROVED).values_list(
            "user_id", flat=True
        )
    )
    today = timezone.localdate()
    lab_open = vm.lab.grant_end_date is None or vm.lab.grant_end_date >= today
    users = []
    for grant in grants:
        account = getattr(grant.user, "unix_account", None)
        if account is None or not account.username:
            continue
        active = (
            grant.state in WANTED_STATES
            and grant.user.is_active
            and grant.user_id in members
            and lab_open
            and (grant.expires_on is None or grant.expires_on >= today)
        )
        keys = tuple(
            key.authorized_keys_line(key_comment(key))
            for key in sorted(grant.user.ssh_keys.all(), key=lambda k: k.pk)
        )
        users.append(
            DesiredUser(
                username=account.username,
                uid=account.uid,
                active=active,
                sudo=active and grant.sudo,
                keys=keys if active else (),
            )
        )
    # Every worker of a pod sees the same disk: one attached read-write there (outside
    # the portal, say) is still mounted read-only on each, never written from several
    # hosts at once. A disk that cannot be mounted (its mount point taken by another
    # disk of the VM) is left out and shown on the VM's page: it never stops the
    # accounts, keys and revokes.
    shared = vm.workers.count() > 1
    mounts = disk_mounts.wanted(disk_mounts.attachments_of(vm), shared=shared).mounts
    return DesiredState(
        users=tuple(users),
        mounts=mounts,
        uid_min=settings.PORTAL_UID_MIN,
        uid_max=settings.PORTAL_UID_MAX,
        series=series(vm),
        version=vm.desired_version,
    )


def series(vm: TpuVm) -> str:
    """The name under which the VM's workers keep the highest version they applied:
    the row and the moment it was made, so a VM registered again (or a test fleet
    host reused by another VM) starts a series of its own."""
    return f"vm{vm.pk}-{int(vm.created_at.timestamp() * 1_000_000)}"


def _lease() -> dt.timedelta:
    return leases.length()


def _claim(vm_id: int, token: str) -> bool:
    """Take the VM's reconcile claim (a short lease) under ``token``; False when
    another run holds it."""
    now = timezone.now()
    return bool(
        TpuVm.objects.filter(pk=vm_id)
        .filter(Q(reconcile_claimed_until__isnull=True) | Q(reconcile_claimed_until__lt=now))
        .update(
            reconcile_claimed_until=now + _lease(),
            reconcile_claim=token,
            reconcile_claim_version=0,
        )
    )


def _take_over(vm_id: int, token: str) -> bool:
    """Take the claim from the run holding it when that run does not carry a revoke
    that is waiting (it read the VM's state before the revoke, or has not read it yet).

    A revoke never waits for another run: not for one that is slow (a worker that
    hangs until the connect timeout) nor for one whose process died (killed worker,
    lost database) and whose lease has not lapsed yet. Nothing checks whether the
    holder is alive, because nothing needs to: the workers refuse an older state
    than one they have applied (``DesiredState.version``), so whichever of the two
    runs reaches a worker last, the revoke stays; the holder's heartbeat and release
    touch only its own token, and it stops before contacting any worker when it sees
    its claim gone."""
    held = (
        TpuVm.objects.filter(pk=vm_id, reconcile_claimed_until__isnull=False)
        .values("reconcile_claim", "reconcile_claim_version")
        .first()
    )
    if held is None:
        return False
    waiting = Grant.objects.filter(
        vm_id=vm_id, state=GrantState.REVOKING, version__gt=held["reconcile_claim_version"]
    ).exists()
    if not waiting:
        return False
    taken = TpuVm.objects.filter(
        pk=vm_id,
        reconcile_claim=held["reconcile_claim"],
        reconcile_claim_version=held["reconcile_claim_version"],
    ).update(
        reconcile_claimed_until=timezone.now() + _lease(),
        reconcile_claim=token,
        reconcile_claim_version=0,
    )
    if taken:
        log.warning(
            "VM %s: a revoke takes the reconcile over from a run at version %s",
            vm_id,
            held["reconcile_claim_version"],
        )
    return bool(taken)


def _release(vm_id: int, token: str) -> None:
    """Give the claim back, if it is still this run's (a revoke may have taken it
    over). Tried a few times: a run that failed because the database went away
    should not hold the VM once it is back. If it still cannot, the lease lapses by
    itself and ``release_stalled_claims`` hands the VM on."""
    for attempt in range(3):
        try:
            TpuVm.objects.filter(pk=vm_id, reconcile_claim=token).update(
                reconcile_claimed_until=None, reconcile_claim="", reconcile_claim_version=0
            )
            return
        except DatabaseError:
            log.warning("cannot release the reconcile claim of VM %s yet", vm_id)
            close_old_connections()
            time.sleep(0.5 * (attempt + 1))


def release_stalled_claims() -> list[int]:
    """VMs whose claim lapsed without being released (the run died: killed worker,
    lost database): clear the claim and return them, to be reconciled again now."""
    now = timezone.now()
    stalled = list(
        TpuVm.objects.filter(reconcile_claimed_until__lt=now).values_list("pk", flat=True)
    )
    released = []
    for vm_id in stalled:
        if TpuVm.objects.filter(pk=vm_id, reconcile_claimed_until__lt=now).update(
            reconcile_claimed_until=None, reconcile_claim="", reconcile_claim_version=0
        ):
            released.append(vm_id)
            log.warning("VM %s: a reconcile stopped renewing its claim; running it again", vm_id)
    return released


def next_try_in(report: ReconcileReport, retries: int) -> float:
    """Seconds before a run that left workers to try again is tried again, after
    ``retries`` tries: soon for a VM still taking the lab's key (``key_retry_delay``),
    backing off for workers that could not be reached (``unreachable_retry_delay``)."""
    if report.waiting_for_key:
        return key_retry_delay(retries)
    return unreachable_retry_delay(retries)


def key_retry_delay(retries: int) -> float:
    """Seconds before trying again a VM whose workers are still taking the lab's key,
    after ``retries`` tries: 0.1, 0.2, 0.4 … (6.3 s in all over six tries; the
    connection check goes on looking after that, and reconciles the VM once they take
    it)."""
    return KEY_RETRY_SECONDS * 2 ** min(retries, 16)


def unreachable_retry_delay(retries: int) -> float:
    """Seconds before trying unreachable workers again after ``retries`` tries: 2, 4,
    8 … up to 300, half of it random so retries of many VMs spread out."""
    base = min(2 ** (retries + 1), 300)
    return base / 2 + random.uniform(0, base / 2)  # noqa: S311 (jitter, not secrecy)


def reconcile_vm(vm_id: int, *, start_placed_jobs: bool = False) -> ReconcileReport:
    """Apply the VM's desired state to every worker, then settle its grants. Runs
    again if the desired state changed while it ran. A run that finds the VM claimed
    leaves it to the holder (which runs again for the change), unless a revoke is
    waiting that the holder does not carry: then it takes the VM over. With
    ``start_placed_jobs``, pool jobs its settle places here start within the run."""
    report = ReconcileReport(vm_id, start_placed_jobs=start_placed_jobs)
    token = secrets.token_hex(16)
    if not (_claim(vm_id, token) or _take_over(vm_id, token)):
        report.busy = True
        return report
    started, outcome = time.monotonic(), "error"
    try:
        while True:
            mine = TpuVm.objects.filter(pk=vm_id, reconcile_claim=token)
            with Heartbeat(mine, "reconcile_claimed_until"):
                _run_once(vm_id, report, token)
            if report.busy:  # taken over by a revoke: the run that took it goes on
                break
            _release(vm_id, token)
            vm = TpuVm.objects.get(pk=vm_id)
            again = vm.desired_version > report.version or _key_taken_since(report)
            if not again or not _claim(vm_id, token):
                break
        outcome = _outcome(report)
    finally:
        _release(vm_id, token)
        took = time.monotonic() - started - report.jobs_start_seconds
        histograms.observe(RECONCILE_DURATION, took, outcome=outcome)
    return report


def reconcile_and_start(vm_id: int) -> ReconcileReport:
    """``reconcile_vm``, starting the pool jobs its settle places on the VM as their
    owners' accounts come (``jobs_placed``) in this process: over the logins the run
    has just made, with no pass to queue, before the run records the rest of what it
    saw. The emails of both go out after."""
    with outbox.first_attempts_held():
        return reconcile_vm(vm_id, start_placed_jobs=True)


def _key_taken_since(report: ReconcileReport) -> bool:
    """A worker refused the lab's key in the run just ended, and the VM's connection
    check has seen every worker take it since that run began: run again at once (the
    check asks for a run of its own only when none is under way)."""
    return (
        report.refused
        and VmConnection.objects.filter(
            vm_id=report.vm_id,
            state=ConnectionState.CONNECTED,
            finished_at__gte=report.run_started,
        ).exists()
    )


def worth_running(vm_id: int, *, retried: bool) -> bool:
    """The VM is there and, for a run tried again, has something left to apply (a new
    VM's key came meanwhile and its connection check reconciled it: nothing is)."""
    if not TpuVm.objects.filter(pk=vm_id).exists():
        return False
    return not (retried and up_to_date(vm_id))


def up_to_date(vm_id: int) -> bool:
    """Every worker of the VM has applied its desired version, and none has an error
    standing (a run now would apply nothing)."""
    desired = TpuVm.objects.filter(pk=vm_id).values_list("desired_version", flat=True).first()
    rows = list(
        Worker.objects.filter(vm_id=vm_id).values_list("sync__applied_version", "sync__last_error")
    )
    return (
        desired is not None
        and bool(rows)
        and all(applied is not None and applied >= desired and not error for applied, error in rows)
    )


def _outcome(report: ReconcileReport) -> str:
    """The reconcile's outcome as ``portal_reconcile_duration_seconds`` labels it."""
    if report.busy:
        return "taken_over"
    return "complete" if report.complete else "incomplete"


def _run_once(vm_id: int, report: ReconcileReport, token: str) -> None:
    with transaction.atomic():
        # Locked while the state is read: a change (which bumps the version on this
        # row) commits wholly before or wholly after, so the version names the state.
        vm = TpuVm.objects.select_for_update(of=("self",)).select_related("lab").get(pk=vm_id)
        version = vm.desired_version
        if not TpuVm.objects.filter(pk=vm_id, reconcile_claim=token).update(
            reconcile_claim_version=version
        ):
            report.busy = True
            return
        # From now on these names exist on hosts: fixed, and reserved for good. A name
        # changed between reading the state and fixing it means reading it again.
        for _ in range(3):
            state = desired_state(vm)
            if mark_names_provisioned([u.username for u in state.users]):
                break
        else:
            raise RuntimeError(f"usernames kept changing while {vm.name}'s state was read")
        workers = list(vm.workers.select_related("sync").order_by("index"))
    report.version = version
    report.ok, report.retryable, report.failed = [], {}, {}
    report.waiting_for_key = report.refused = False
    report.run_started = timezone.now()
    try:
        data = encode(state)
    except ValueError as exc:
        # The database holds something hosts must never see (a UID outside the
        # configured range, say): contact no worker; the grants fail with the reason.
        for worker in workers:
            report.failed[worker.index] = str(exc)
            _record(worker, version, error=str(exc), retryable=False)
        settle_grants(vm_id)
        return
    reachable = []
    for worker in workers:
        skipped = _why_skipped(worker)
        if skipped is None:
            reachable.append(worker)
            continue
        reason, retryable = skipped
        (report.retryable if retryable else report.failed)[worker.index] = reason
        _record(worker, version, error=reason, retryable=retryable)
    # Only ever the VM's own lab's key: a host that was never given it refuses us.
    login = login_for(vm.lab) if reachable else None
    looked_at = timezone.now()  # the next look at a late disk counts from here
    outcomes = run_on_workers([remote_worker(w, login) for w in reachable], "reconcile.sh", data)
    # Another host key at a worker's address: first ask whether Google made the node
    # anew (new machines, new keys) since the pins were taken. Then it is re-pinned and
    # this loop runs again for it, with no alarm.
    made_anew_now = any(
        isinstance(o.error, HostKeyMismatch) for o in outcomes if not o.ok
    ) and made_anew.recognise(vm)
    for worker, outcome in zip(reachable, outcomes, strict=True):
        if outcome.ok:
            result = outcome.result
            never_sent = _version_never_sent(vm_id, result.values.get("stale", ""))
            if never_sent:
                report.failed[worker.index] = never_sent
                _record(worker, version, error=never_sent, retryable=False, mendable=True)
                continue
            answer = {
                "values": result.values,
                "user_error": result.all("user_error"),
                "drift_user": result.all("drift_user"),
                "waiting_device": result.all("waiting_device"),
                "mount_error": result.all("mount_error"),
                "disk_error": result.all("disk_error"),
            }
            report.ok.append(worker.index)
            report.changed += int(result.values.get("changed", "0") or 0)
            if worker.host_key_mismatch_at:
                _host_key_matches_again(worker)
            _record(worker, version, answer=answer, boot_id=result.values.get("boot_id", ""))
            continue
        error = outcome.error
        if isinstance(error, HostKeyMismatch) and made_anew_now:
            why = "the VM was made anew on new machines; their host keys are pinned again"
            report.retryable[worker.index] = why
            _record(worker, version, error=why, retryable=True)
            continue
        if isinstance(error, HostKeyMismatch):
            raise_alarm(worker, str(getattr(error, "presented", "") or ""))
        report.refused |= error.kind == RemoteError.AUTH
        if error.kind == RemoteError.AUTH and _still_connecting(vm_id):
            # The lab's key is on its way to the workers (a VM just made, or just
            # connected): not a failure yet. The connection check reconciles the VM
            # once every worker accepts the key; it fails the VM itself if none does.
            why = "the VM is still taking the lab's key (connecting); tried again then"
            report.waiting_for_key = True
            report.retryable[worker.index] = why
            _record(worker, version, error=why, retryable=True)
            continue
        bucket = report.retryable if error.retryable else report.failed
        bucket[worker.index] = str(error)
        _record(
            worker,
            version,
            error=str(error),
            retryable=error.retryable,
            mendable=error.kind not in NOT_MENDED_ON_THE_HOST,
        )
    if settle_grants(vm_id, starts_jobs=True):
        report.jobs_placed = True
        if report.start_placed_jobs:
            began = time.monotonic()
            _start_placed_jobs(vm_id)
            report.jobs_start_seconds += time.monotonic() - began
    disk_mounts.after_run(vm_id, report.ok, looked_at=looked_at)
    if len(report.ok) == len(workers) and workers:
        # Every worker took the lab's key: a VM still connecting is connected now.
        connect.confirmed_by_reconcile(vm_id)
    audit.record(
        AuditAction.VM_RECONCILED,
        lab=vm.lab,
        summary=f"{vm.name} v{version}: {len(report.ok)}/{len(workers)} workers, "
        f"{report.changed} change(s)",
        data={
            "vm": vm.pk,
            "version": version,
            "ok": report.ok,
            "retryable": report.retryable,
            "failed": report.failed,
        },
    )


def _start_placed_jobs(vm_id: int) -> None:
    """The pass that starts the jobs just placed here, in this run (its person waits
    for nothing else the run does). Should it fail, the VM's own pass is queued to
    start them, and the run goes on to record what it saw."""
    try:
        job_engine.advance(vm_id)
    except Exception:
        log.exception("starting the jobs placed on VM %s in its reconcile failed", vm_id)
        queue.advance_jobs(vm_id)


def _still_connecting(vm_id: int) -> bool:
    """Whether the VM is waiting for its workers to accept the lab's key."""
    return VmConnection.objects.filter(vm_id=vm_id, state=ConnectionState.CONNECTING).exists()


def _version_never_sent(vm_id: int, stale: str) -> str:
    """Why a worker's "stale" answer cannot be believed ("" when it can): it says it
    holds a newer version of the VM's state than this run's, which is fine when another
    run sent it, but a version the portal never made means someone with root on the
    worker wrote the file, and taking the answer would let them skip every change
    (a revoke of their own account included) while the portal counts it applied."""
    if not stale:
        return ""
    current = TpuVm.objects.values_list("desired_version", flat=True).get(pk=vm_id)
    if stale.isdigit() and int(stale) <= current:
        return ""
    return (
        f"the worker says it holds version {stale[:20]} of the VM's desired state, which "
        f"the portal never sent (it is at {current}): someone with root there changed "
        "/var/lib/tpu-portal/version. Nothing was applied; remove that file on the "
        "worker, then retry."
    )


def _why_skipped(worker: Worker) -> tuple[str, bool] | None:
    """Why the portal will not contact this worker now, and whether that can pass.

    A worker with a host key alarm is still contacted, whatever raised it: the
    connection checks the pinned key before any credential is sent, so a host that
    presents another key learns nothing and changes nothing (the run fails for it,
    and the real host back at its address clears the alarm by itself), while one whose
    alarm came only from the keys the API publishes (guest attributes, which any
    process on the VM may write) and still presents its pinned key is the host the
    portal knows: it keeps being reconciled, and revokes reach it."""
    if not worker.is_pinned:
        return "no pinned host key", False
    if not worker.external_ip:
        return "no external IP (under maintenance?)", True
    return None


def _record(
    worker: Worker,
    version: int,
    *,
    answer=None,
    error="",
    retryable=False,
    boot_id="",
    mendable=False,
):
    """Store what one worker did in this run. Read afresh: another run (a revoke that
    took the VM over) may have recorded a newer version meanwhile, and what an older
    run saw then neither replaces its answer nor counts as this worker's error. A
    failure the host can get over (``mendable``) is tried again after a back-off."""
    now = timezone.now()
    sync, _ = WorkerSync.objects.get_or_create(worker=worker)
    newer = sync.applied_version > version or (
        answer is not None and bool(answer["values"].get("stale"))
    )
    if newer:
        if answer is not None:  # the worker holds this version or a newer one
            WorkerSync.objects.filter(pk=sync.pk, applied_version__lt=version).update(
                applied_version=version
            )
        return
    sync.last_attempt_at = now
    if answer is not None:
        before = set((sync.last_report or {}).get("drift_user", []))
        new_drift = sorted(set(answer["drift_user"]) - before)
        if new_drift:
            _drift_found(worker, new_drift)
        sync.applied_version = max(sync.applied_version, version)
        sync.last_success_at = now
        sync.last_error, sync.last_error_retryable, sync.failures = "", False, 0
        sync.last_report = answer
        sync.retry_at = None
    else:
        sync.last_error, sync.last_error_retryable = error[:2000], retryable
        sync.failures += 1
        sync.retry_at = now + retry_delay(sync.failures) if mendable and not retryable else None
    sync.save()
    if boot_id and boot_id != worker.boot_id:
        # A new boot may be a new host: the next sync compares its published keys.
        Worker.objects.filter(pk=worker.pk).update(
            boot_id=boot_id[:64], published_keys_recheck=bool(worker.boot_id)
        )
        if worker.boot_id:
            audit.record(
                AuditAction.WORKER_REBOOTED,
                lab=worker.vm.lab,
                summary=f"{worker.alias} rebooted since the last reconcile",
                data={"worker": worker.pk, "boot_id": boot_id[:64]},
            )


def _drift_found(worker: Worker, usernames: list[str]) -> None:
    """Accounts in the portal's UID range that the portal did not make: reported to
    the lab's admins (never deleted: they may hold someone's files)."""
    with transaction.atomic():
        audit.record(
            AuditAction.DRIFT_FOUND,
            lab=worker.vm.lab,
            summary=f"{worker.alias}: {', '.join(usernames)}"[:300],
            data={"worker": worker.pk, "users": usernames},
        )
        emails.send_drift_alert(worker.pk, usernames)


def _host_key_matches_again(worker: Worker) -> None:
    """The worker presented its pinned key again (the impostor at its address is gone,
    or the address came back to the real host): the alarm ends, on the record."""
    # An alarm about the published keys stays: presenting the pinned key says nothing
    # about what the API publishes; an admin resumes or re-pins.
    if Worker.objects.filter(
        pk=worker.pk, host_key_mismatch_at__isnull=False, host_key_alarm_published=False
    ).update(host_key_mismatch_at=None, presented_host_key=""):
        audit.record(
            AuditAction.HOST_KEY_ALARM_CLEARED,
            lab=worker.vm.lab,
            summary=f"{worker.alias} presents its pinned host key again",
            data={"worker": worker.pk, "alarm_since": worker.host_key_mismatch_at.isoformat()},
        )


def settle_grants(vm_id: int, *, starts_jobs: bool = False) -> bool:
    """Grants whose change every worker has applied are in force now; a grant that a
    worker refused for good has failed, with the host's reason. Pool jobs that waited
    for the VM's kind are placed; with ``starts_jobs`` the caller starts the ones
    placed here itself (no pass is queued for them). True when one was."""
    workers = list(Worker.objects.filter(vm_id=vm_id).select_related("sync"))
    syncs = [getattr(w, "sync", None) for w in workers]
    applied = min((s.applied_version if s else 0) for s in syncs) if syncs else 0
    user_errors: dict[str, tuple[str, str]] = {}  # username -> (worker alias, reason)
    for worker, sync in zip(workers, syncs, strict=True):
        for entry in (sync.last_report or {}).get("user_error", []) if sync else []:
            name, _, reason = entry.partition(":")
            user_errors.setdefault(name, (worker.alias, reason))
    hard_errors = {
        w.alias: s.last_error
        for w, s in zip(workers, syncs, strict=True)
        if s and s.last_error and not s.last_error_retryable
    }
    now = timezone.now()
    _tell_back(vm_id, applied)
    # A failed grant is still wanted: once every worker has applied it (the worker came
    # back, the cause was fixed), it is in force like a pending one.
    waiting = Grant.objects.filter(
        vm_id=vm_id, state__in=(GrantState.PENDING, GrantState.FAILED)
    ).select_related("user__unix_account", "vm__lab")
    activated, placed_here = None, False
    # Each email is stored with its grant's change; their first sends wait until the
    # waiting pool job is placed and its VM's pass queued (in a reconcile, until the
    # job has started: ``reconcile_and_start`` holds them).
    with outbox.first_attempts_held():
        for grant in waiting:
            username = getattr(getattr(grant.user, "unix_account", None), "username", "")
            if username in user_errors:
                alias, reason = user_errors[username]
                _fail(grant, clash_message(username, alias, reason), retry=True)
            elif hard_errors:
                why = "; ".join(f"{alias}: {err}" for alias, err in sorted(hard_errors.items()))
                _fail(grant, why)
            elif grant.version <= applied and _activate(grant, now):
                activated = grant.vm
        kind = _pool_jobs_wait_for(activated) if activated is not None else None
        if kind is not None:
            # A job for any VM of this kind may run here now (a VM just made for it by
            # the elastic pool): it is placed now, and started at once, by the caller
            # (``starts_jobs``: the reconcile, over the connections it just used) or by
            # the pass queued for it.
            placed = scheduler.place(*kind, in_pass_of=vm_id if starts_jobs else None)
            placed_here = starts_jobs and any(p.vm_id == vm_id for p in placed)
    revoking = Grant.objects.filter(vm_id=vm_id, state=GrantState.REVOKING, version__lte=applied)
    for grant in revoking.select_related("user", "vm__lab"):
        # The email is in the outbox in the same transaction as the change it tells of.
        with transaction.atomic():
            if Grant.objects.filter(pk=grant.pk, state=GrantState.REVOKING).update(
                state=GrantState.REVOKED, revoked_at=now, changed_at=now
            ):
                emails.send_grant_email(grant.pk, "revoked")
                # From the revoke (its state change) to every worker having applied it.
                histograms.observe(REVOKE_DURATION, (now - grant.changed_at).total_seconds())
    return placed_here


def _tell_back(vm_id: int, applied: int) -> None:
    """A VM made anew after Google took it back has everything on every worker again:
    it is whole (jobs may start) and the people with access hear it once (before the
    grants this pass puts in force, which get their own "You can now use" email)."""
    with transaction.atomic():
        if TpuVm.objects.filter(pk=vm_id, restore_version__lte=applied).update(
            restore_version=None, restored_at=timezone.now()
        ):
            emails.send_vm_back(vm_id)


def _pool_jobs_wait_for(vm: TpuVm) -> tuple[int, str] | None:
    """The VM's (lab, type) when jobs of its lab wait for any VM of its type (``vm``:
    as the settle read it with its grants)."""
    if not vm.accelerator_type:
        return None
    waiting = Job.objects.filter(
        lab_id=vm.lab_id,
        vm__isnull=True,
        state=JobState.QUEUED,
        accelerator_type=vm.accelerator_type,
    ).exists()
    return (vm.lab_id, vm.accelerator_type) if waiting else None


def _activate(grant: Grant, now) -> bool:
    """The grant is in force: recorded, audited and its "You can now use …" email put
    in the outbox in one transaction, so no worker's death can lose the email. False
    when another pass put it in force first."""
    with transaction.atomic():
        if Grant.objects.filter(pk=grant.pk, state=grant.state, version=grant.version).update(
            state=GrantState.ACTIVE,
            activated_at=now,
            error="",
            changed_at=now,
            retry_at=None,
            failures=0,
        ):
            audit.record(
                AuditAction.GRANT_ACTIVE,
                lab=grant.vm.lab,
                target_user=grant.user,
                summary=grant.vm.name,
                data={"grant": grant.pk},
            )
            emails.send_access_active(grant)
            return True
    return False


_OWNER = re.compile(r"^(?:uid|gid) \d+ belongs to (?:the group )?(\S+)$")


def clash_message(username: str, alias: str, reason: str) -> str:
    """What a worker's refusal of one person means, and what an admin can do."""
    owner = _OWNER.match(reason)
    if owner:
        advice = (
            f"The local account {owner.group(1)} on {alias} holds the number the portal "
            f"gives {username}: remove or renumber it there (it was not made by the portal)."
        )
    elif "already exists" in reason:
        advice = (
            f"The name {username} is taken on {alias} by something the portal did not make: "
            "remove it there, or give the person another username."
        )
    else:
        advice = f"Fix it on {alias}."
    return (
        f"{alias} refused {username}: {reason}. {advice} The portal tries again by itself; "
        "the other workers keep the account ready."
    )


def retry_delay(failures: int) -> dt.timedelta:
    """How long a grant, or a worker that failed for a reason the host can get over,
    waits before the next try after its ``failures``-th failure."""
    base = settings.PORTAL_GRANT_RETRY_SECONDS
    cap = settings.PORTAL_GRANT_RETRY_MAX_SECONDS
    return dt.timedelta(seconds=min(base * 2 ** min(max(0, failures - 1), 20), cap))


def _fail(grant: Grant, reason: str, *, retry: bool = False) -> None:
    """The grant failed (again). The first failure is audited and mailed; a retryable
    one is tried again later by the sweep, further apart each time."""
    failures = grant.failures + 1
    retry_at = timezone.now() + retry_delay(failures) if retry else None
    if grant.state == GrantState.FAILED:
        Grant.objects.filter(pk=grant.pk, state=GrantState.FAILED).update(
            error=reason[:2000], retry_at=retry_at, failures=failures, changed_at=timezone.now()
        )
        return
    with transaction.atomic():
        if Grant.objects.filter(pk=grant.pk, state=GrantState.PENDING).update(
            state=GrantState.FAILED,
            error=reason[:2000],
            retry_at=retry_at,
            failures=failures,
            changed_at=timezone.now(),
        ):
            audit.record(
                AuditAction.GRANT_FAILED,
                lab=grant.vm.lab,
                target_user=grant.user,
                summary=f"{grant.vm.name}: {reason}"[:300],
                data={"grant": grant.pk, "reason": reason[:2000]},
            )
            emails.send_grant_email(grant.pk, "failed")


def give_up(vm_id: int) -> None:
    """Retries are exhausted: pending grants on workers that stayed unreachable fail.
    Not while the VM is still taking the lab's key: the connection check reconciles
    it once every worker does, and says so if they never do."""
    if _still_connecting(vm_id):
        return
    for sync in WorkerSync.objects.filter(worker__vm_id=vm_id).exclude(last_error=""):
        WorkerSync.objects.filter(pk=sync.pk).update(last_error_retryable=False)
    settle_grants(vm_id)

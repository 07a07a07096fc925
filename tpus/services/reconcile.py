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
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.unix import mark_names_provisioned
from tpus import audit, notify
from tpus.models import (
    AuditAction,
    DiskAttachment,
    Grant,
    Membership,
    TpuVm,
    Worker,
    WorkerSync,
)
from tpus.models.grants import WANTED_STATES, GrantState
from tpus.models.inventory import DiskMode
from tpus.models.labs import MembershipState
from tpus.remote import HostKeyMismatch, HostKeyPins, run_on_workers
from tpus.remote import Worker as RemoteWorker
from tpus.remote.desired import DesiredMount, DesiredState, DesiredUser, encode

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    vm_id: int
    version: int = 0
    busy: bool = False
    ok: list[int] = field(default_factory=list)  # worker indexes
    retryable: dict[int, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    changed: int = 0

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
    # hosts at once.
    shared = vm.workers.count() > 1
    mounts = tuple(
        DesiredMount(
            device=a.disk.name,
            mount_point=a.disk.mount_point,
            read_only=shared or a.mode == DiskMode.READ_ONLY,
        )
        for a in DiskAttachment.objects.filter(vm=vm).select_related("disk").order_by("disk__name")
    )
    return DesiredState(
        users=tuple(users),
        mounts=mounts,
        uid_min=settings.PORTAL_UID_MIN,
        uid_max=settings.PORTAL_UID_MAX,
    )


def _claim(vm_id: int) -> bool:
    """Take the VM's reconcile claim; False when another run holds it."""
    now = timezone.now()
    return bool(
        TpuVm.objects.filter(pk=vm_id)
        .filter(Q(reconcile_claimed_until__isnull=True) | Q(reconcile_claimed_until__lt=now))
        .update(
            reconcile_claimed_until=now
            + dt.timedelta(seconds=settings.PORTAL_RECONCILE_CLAIM_SECONDS)
        )
    )


def _release(vm_id: int) -> None:
    TpuVm.objects.filter(pk=vm_id).update(reconcile_claimed_until=None)


def _remote(worker: Worker) -> RemoteWorker:
    return RemoteWorker(
        address=worker.external_ip or "",
        pins=HostKeyPins.parse(worker.host_keys),
        name=worker.alias,
    )


def reconcile_vm(vm_id: int) -> ReconcileReport:
    """Apply the VM's desired state to every worker, then settle its grants. Runs
    again if the desired state changed while it ran."""
    report = ReconcileReport(vm_id)
    if not _claim(vm_id):
        report.busy = True
        return report
    try:
        while True:
            _run_once(vm_id, report)
            _release(vm_id)
            vm = TpuVm.objects.get(pk=vm_id)
            if vm.desired_version <= report.version or not _claim(vm_id):
                break
    finally:
        _release(vm_id)
    return report


def _run_once(vm_id: int, report: ReconcileReport) -> None:
    with transaction.atomic():
        vm = TpuVm.objects.select_related("lab").get(pk=vm_id)
        version = vm.desired_version
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
    outcomes = run_on_workers([_remote(w) for w in reachable], "reconcile.sh", data)
    for worker, outcome in zip(reachable, outcomes, strict=True):
        if outcome.ok:
            result = outcome.result
            answer = {
                "values": result.values,
                "user_error": result.all("user_error"),
                "drift_user": result.all("drift_user"),
                "waiting_device": result.all("waiting_device"),
            }
            report.ok.append(worker.index)
            report.changed += int(result.values.get("changed", "0") or 0)
            _record(worker, version, answer=answer, boot_id=result.values.get("boot_id", ""))
            continue
        error = outcome.error
        if isinstance(error, HostKeyMismatch):
            _host_key_changed(worker, error)
        bucket = report.retryable if error.retryable else report.failed
        bucket[worker.index] = str(error)
        _record(worker, version, error=str(error), retryable=error.retryable)
    settle_grants(vm_id)
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


def _why_skipped(worker: Worker) -> tuple[str, bool] | None:
    """Why the portal will not contact this worker now, and whether that can pass."""
    if worker.host_key_mismatch_at:
        return "its host key changed; an admin must review it", False
    if not worker.is_pinned:
        return "no pinned host key", False
    if not worker.external_ip:
        return "no external IP (under maintenance?)", True
    return None


def _record(worker: Worker, version: int, *, answer=None, error="", retryable=False, boot_id=""):
    """Store what one worker did in this run."""
    now = timezone.now()
    try:
        sync = worker.sync  # loaded with the worker
    except WorkerSync.DoesNotExist:
        sync, _ = WorkerSync.objects.get_or_create(worker=worker)
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
    else:
        sync.last_error, sync.last_error_retryable = error[:2000], retryable
        sync.failures += 1
    sync.save()
    if boot_id and boot_id != worker.boot_id:
        Worker.objects.filter(pk=worker.pk).update(boot_id=boot_id[:64])
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
    audit.record(
        AuditAction.DRIFT_FOUND,
        lab=worker.vm.lab,
        summary=f"{worker.alias}: {', '.join(usernames)}"[:300],
        data={"worker": worker.pk, "users": usernames},
    )
    notify.drift_found(worker, usernames)


def _host_key_changed(worker: Worker, error: HostKeyMismatch) -> None:
    """Stop provisioning this worker and tell the lab's admins, once per change."""
    presented = getattr(error, "presented", "") or ""
    updated = Worker.objects.filter(pk=worker.pk, host_key_mismatch_at=None).update(
        host_key_mismatch_at=timezone.now(), presented_host_key=str(presented)[:2000]
    )
    if updated:
        audit.record(
            AuditAction.HOST_KEY_CHANGED,
            lab=worker.vm.lab,
            summary=f"{worker.alias} presented a host key that is not the pinned one",
            data={"worker": worker.pk, "presented": str(presented)[:2000]},
        )
        notify.host_key_changed(worker)


def settle_grants(vm_id: int) -> None:
    """Grants whose change every worker has applied are in force now; a grant that a
    worker refused for good has failed, with the host's reason."""
    workers = list(Worker.objects.filter(vm_id=vm_id).select_related("sync"))
    syncs = [getattr(w, "sync", None) for w in workers]
    applied = min((s.applied_version if s else 0) for s in syncs) if syncs else 0
    user_errors = {}
    for sync in syncs:
        for entry in (sync.last_report or {}).get("user_error", []) if sync else []:
            name, _, reason = entry.partition(":")
            user_errors.setdefault(name, reason)
    hard_errors = {
        w.alias: s.last_error
        for w, s in zip(workers, syncs, strict=True)
        if s and s.last_error and not s.last_error_retryable
    }
    now = timezone.now()
    # A failed grant is still wanted: once every worker has applied it (the worker came
    # back, the cause was fixed), it is in force like a pending one.
    waiting = Grant.objects.filter(
        vm_id=vm_id, state__in=(GrantState.PENDING, GrantState.FAILED)
    ).select_related("user__unix_account", "vm__lab")
    for grant in waiting:
        username = getattr(getattr(grant.user, "unix_account", None), "username", "")
        if username in user_errors:
            _fail(grant, f"The host refused {username}: {user_errors[username]}")
        elif hard_errors:
            _fail(grant, "; ".join(f"{alias}: {err}" for alias, err in sorted(hard_errors.items())))
        elif grant.version <= applied:
            if Grant.objects.filter(pk=grant.pk, state=grant.state, version=grant.version).update(
                state=GrantState.ACTIVE, activated_at=now, error=""
            ):
                audit.record(
                    AuditAction.GRANT_ACTIVE,
                    lab=grant.vm.lab,
                    target_user=grant.user,
                    summary=grant.vm.name,
                    data={"grant": grant.pk},
                )
                notify.access_active(grant)
    revoking = Grant.objects.filter(vm_id=vm_id, state=GrantState.REVOKING, version__lte=applied)
    for grant in revoking.select_related("user", "vm__lab"):
        if Grant.objects.filter(pk=grant.pk, state=GrantState.REVOKING).update(
            state=GrantState.REVOKED, revoked_at=now
        ):
            notify.access_revoked(grant)


def _fail(grant: Grant, reason: str) -> None:
    if Grant.objects.filter(pk=grant.pk, state=GrantState.PENDING).update(
        state=GrantState.FAILED, error=reason[:2000]
    ):
        audit.record(
            AuditAction.GRANT_FAILED,
            lab=grant.vm.lab,
            target_user=grant.user,
            summary=f"{grant.vm.name}: {reason}"[:300],
            data={"grant": grant.pk, "reason": reason[:2000]},
        )
        notify.grant_failed(grant)


def give_up(vm_id: int) -> None:
    """Retries are exhausted: pending grants on workers that stayed unreachable fail."""
    for sync in WorkerSync.objects.filter(worker__vm_id=vm_id).exclude(last_error=""):
        WorkerSync.objects.filter(pk=sync.pk).update(last_error_retryable=False)
    settle_grants(vm_id)

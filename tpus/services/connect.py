"""Connecting a TPU VM to its lab: the lab's public key goes into the node's
``ssh-keys`` metadata through the Cloud TPU API, Google's guest agent creates the
portal's account with sudo on every worker, and the portal waits until each worker
accepts the lab's key with its pinned host key. Disconnect takes the line out again.

The metadata change happens in the admin's request (it is one API call and its
operation); the wait for the workers is queued work that records progress per worker:
short checks, each looking at every worker once and queuing the next with a
countdown, so no Celery worker sleeps while a lab's VMs come up.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from portal import audit
from tpus import access, queue
from tpus.cloud import CloudError, KeyLine, cloud_tpu
from tpus.cloud.sshkeys import OSLOGIN, is_true
from tpus.models import AuditAction, ConnectionState, Lab, TpuVm, VmConnection, Worker
from tpus.models.inventory import VmSource
from tpus.remote import HostKeyPins, RemoteError, run_on_workers
from tpus.remote import Worker as RemoteWorker
from tpus.services.hosts import forget_connections
from tpus.services.labkeys import lab_key, login_for

WAITING, ACCEPTED, REFUSED = "waiting", "accepted", "refused"

# Shown when workers still refuse the key after the wait: what usually causes it.
WHY_REFUSED = (
    "The lab's key is in the node's ssh-keys metadata, but the workers did not accept it "
    "in time. Likely causes: OS Login is enabled for the project (enable-oslogin=TRUE in "
    "the project's Compute Engine metadata turns metadata keys off; set it to FALSE on "
    "the node or the project), or Google's guest agent is not running on the workers "
    "(it creates the account from ssh-keys). block-project-ssh-keys does not matter: "
    "the key is a node key, not a project key."
)


class ConnectError(Exception):
    """Connect or Disconnect was refused or failed; the message says why and what to do."""


@dataclass(frozen=True)
class ManualRoute:
    """What an admin needs to connect the VM by hand."""

    line: str  # tpu-portal:ssh-ed25519 AAAA… tpu-portal@lab
    command: str  # the gcloud command


def key_line(vm: TpuVm) -> KeyLine:
    return KeyLine(settings.PORTAL_LAB_SSH_USER, lab_key(vm.lab).public_line)


def manual_route(vm: TpuVm) -> ManualRoute:
    line = key_line(vm).text
    command = (
        f"gcloud compute tpus tpu-vm update {vm.name} --zone={vm.zone} "
        f"--project={vm.lab.gcp_project_id} --update-metadata=ssh-keys='<existing lines>\n{line}'"
    )
    return ManualRoute(line=line, command=command)


def connection_of(vm: TpuVm) -> VmConnection:
    """The VM's connection record (not connected, when none was ever made)."""
    return VmConnection.objects.filter(vm=vm).first() or VmConnection(vm=vm)


def _check(admin, vm: TpuVm) -> None:
    if not access.is_lab_admin(admin, vm.lab):
        raise ConnectError("Only the lab's admins connect its TPU VMs.")
    if vm.lab.uses_site_key:
        raise ConnectError(
            f"{vm.lab.name} logs in to its workers with the site-wide SSH key (a site "
            "admin's choice), not with a key of its own, so there is nothing to connect: "
            "the site-wide key's account must already be on the VM."
        )
    if vm.source == VmSource.MANUAL:
        raise ConnectError(
            f"{vm.name} was registered by hand, so the portal cannot change its metadata "
            "through the Cloud TPU API. Add the lab's key to the VM yourself (see below)."
        )


def _explain(error: CloudError, vm: TpuVm) -> str:
    project = vm.lab.gcp_project_id
    if error.code == "PERMISSION_DENIED":
        return (
            f"The portal's service account lacks tpu.nodes.update on {project}: grant it "
            "roles/tpu.admin there, or add the key by hand with the gcloud line below."
        )
    if error.code == "NOT_FOUND":
        return f"The Cloud TPU API does not know {vm.name} in {vm.zone} of {project}."
    return str(error)


def _node(vm: TpuVm) -> tuple[str, str, str]:
    return (vm.lab.gcp_project_id, vm.zone, vm.name)


def connect_vm(admin, vm: TpuVm, *, request=None) -> VmConnection:
    """Add the lab's key line to the node's ``ssh-keys`` and queue the wait for the
    workers. Raises ConnectError (and changes nothing) when it cannot."""
    _check(admin, vm)
    key = key_line(vm)
    client = cloud_tpu()
    try:
        metadata = client.node_metadata(*_node(vm))
        if is_true(metadata.get(OSLOGIN)):
            oslogin = (
                f"OS Login is enabled on {vm.name} ({OSLOGIN}={metadata[OSLOGIN]} in its "
                "metadata), so its workers ignore ssh-keys. Set enable-oslogin=FALSE on the "
                f"node (gcloud compute tpus tpu-vm update {vm.name} --zone={vm.zone} "
                f"--project={vm.lab.gcp_project_id} --update-metadata=enable-oslogin=FALSE) "
                "and connect again."
            )
            _refused_up_front(admin, vm, oslogin, request=request)
            raise ConnectError(oslogin)
        change = client.add_ssh_key(*_node(vm), key)
    except CloudError as error:
        raise ConnectError(_explain(error, vm)) from error
    with transaction.atomic():
        connection = wait_for_workers(vm, admin)
        audit.record(
            AuditAction.VM_CONNECT_REQUESTED,
            actor=admin,
            lab=vm.lab,
            summary=f"{key.user} key added to {vm.name}'s ssh-keys"
            + ("" if change.changed else " (it was already there)"),
            data={"vm": vm.pk, "attempts": change.attempts, "changed": change.changed},
            request=request,
        )
    return connection


def wait_for_workers(vm: TpuVm, by) -> VmConnection:
    """The lab's key line is in the node's metadata (just added, or there since the
    node was made): mark the VM connecting and queue the check that waits until every
    worker accepts the key. Call inside a transaction."""
    connection, _ = VmConnection.objects.select_for_update().get_or_create(vm=vm)
    connection.state = ConnectionState.CONNECTING
    connection.reason = ""
    connection.workers = {str(w.index): {"state": WAITING, "detail": ""} for w in vm.workers.all()}
    connection.requested_by = by
    connection.started_at = timezone.now()
    connection.finished_at = None
    connection.attempt += 1
    connection.checks = 0
    connection.next_check_at = connection.started_at
    connection.save()
    queue.check_vm_connection(connection.pk, connection.attempt, 0)
    return connection


def _refused_up_front(admin, vm: TpuVm, reason: str, *, request=None) -> None:
    """Connect was refused before anything changed, for a reason that holds for the
    workers too (OS Login on the node: they ignore ssh-keys): the VM's page keeps it as
    the connection's state, not only as a message that is gone on the next page."""
    with transaction.atomic():
        connection, _ = VmConnection.objects.select_for_update().get_or_create(vm=vm)
        connection.state = ConnectionState.FAILED
        connection.reason = reason
        connection.workers = {}
        connection.requested_by = admin
        connection.started_at = connection.finished_at = timezone.now()
        connection.attempt += 1  # a check still running stops writing
        connection.save()
        audit.record(
            AuditAction.VM_CONNECT_FAILED,
            actor=admin,
            lab=vm.lab,
            summary=f"{vm.name}: {reason}"[:300],
            data={"vm": vm.pk, "refused_up_front": True},
            request=request,
        )


def disconnect_vm(admin, vm: TpuVm, *, request=None) -> VmConnection:
    """Remove the lab's key line from the node's ``ssh-keys``; every other line stays."""
    _check(admin, vm)
    key = key_line(vm)
    try:
        change = cloud_tpu().remove_ssh_key(*_node(vm), key)
    except CloudError as error:
        raise ConnectError(_explain(error, vm)) from error
    with transaction.atomic():
        connection, _ = VmConnection.objects.select_for_update().get_or_create(vm=vm)
        connection.state = ConnectionState.DISCONNECTED
        connection.reason = ""
        connection.workers = {}
        connection.requested_by = admin
        connection.finished_at = timezone.now()
        connection.attempt += 1  # a check still running stops writing
        connection.save()
        forget_connections(Worker.objects.filter(vm=vm))
        audit.record(
            AuditAction.VM_DISCONNECTED,
            actor=admin,
            lab=vm.lab,
            summary=f"{key.user} key removed from {vm.name}'s ssh-keys"
            + ("" if change.changed else " (it was not there)"),
            data={"vm": vm.pk, "changed": change.changed},
            request=request,
        )
    return connection


# A check is presumed lost (its task gone with a broker or a worker) this long after
# it was due; the sweep queues it again. Queued twice, it still runs once.
LOST_AFTER_SECONDS = 60
# The first looks again after Connect: a new node's guest agent puts the key in place
# within a second or two of boot, so look soon at first (twice after this pause, the
# key is often there a few tenths of a second in: a VM an elastic pool made waits for
# it before its first job), then less often (the pause doubling each look).
FIRST_PAUSE_SECONDS = 0.1


def stalled_connections() -> list[tuple[int, int, int]]:
    """Connections still "connecting" whose next check is long overdue (its task was
    lost, or the worker running it died): ``(id, attempt, check)`` to queue again. A
    row an earlier version left without a due time counts from when it started."""
    now = timezone.now()
    late = now - dt.timedelta(seconds=LOST_AFTER_SECONDS)
    old = now - dt.timedelta(seconds=float(settings.PORTAL_CONNECT_WAIT_SECONDS) + 60)
    return list(
        VmConnection.objects.filter(state=ConnectionState.CONNECTING)
        .filter(Q(next_check_at__lt=late) | Q(next_check_at=None, started_at__lt=old))
        .order_by("pk")
        .values_list("pk", "attempt", "checks")
    )


def _look_seconds() -> float:
    """How long one look at the workers may take (they are tried all at once)."""
    return float(settings.PORTAL_REMOTE_CONNECT_TIMEOUT + settings.PORTAL_REMOTE_AUTH_TIMEOUT + 30)


def _claim(connection_id: int, attempt: int, check: int | None) -> VmConnection | None:
    """Take the attempt's next look with a conditional UPDATE of its count: a check
    queued twice runs once, and one for an older attempt (Connect pressed again,
    Disconnect) not at all. ``None`` (a task an earlier version queued) takes
    whichever look is current."""
    rows = VmConnection.objects.filter(
        pk=connection_id, attempt=attempt, state=ConnectionState.CONNECTING
    )
    if check is not None:
        rows = rows.filter(checks=check)
    until = timezone.now() + dt.timedelta(seconds=_look_seconds())
    if not rows.update(checks=F("checks") + 1, next_check_at=until):
        return None
    return VmConnection.objects.select_related("vm__lab").get(pk=connection_id)


# How soon a check that found another of its lab's checks trying workers asks again.
TURN_WAIT_SECONDS = 1.0


def _take_turn(connection_id: int, attempt: int) -> bool | None:
    """Whether this check may try its workers now: no check of the VM's lab is trying
    workers (each try is bounded by the SSH timeouts, and workers that hang take all of
    them), this VM's included (the same check queued twice). None when the connection
    no longer waits for this attempt."""
    lab_id = (
        VmConnection.objects.filter(
            pk=connection_id, attempt=attempt, state=ConnectionState.CONNECTING
        )
        .values_list("vm__lab_id", flat=True)
        .first()
    )
    if lab_id is None:
        return None
    now = timezone.now()
    with transaction.atomic():
        list(Lab.objects.select_for_update().filter(pk=lab_id).values_list("pk"))
        if VmConnection.objects.filter(vm__lab_id=lab_id, looking_until__gt=now).exists():
            return False
        VmConnection.objects.filter(pk=connection_id).update(
            looking_until=now + dt.timedelta(seconds=_look_seconds())
        )
    return True


def _wait_turn(connection_id: int, attempt: int, check: int | None) -> None:
    """Ask again soon, holding no Celery worker meanwhile."""
    due = timezone.now() + dt.timedelta(seconds=TURN_WAIT_SECONDS)
    if VmConnection.objects.filter(
        pk=connection_id, attempt=attempt, state=ConnectionState.CONNECTING
    ).update(next_check_at=due):
        queue.check_vm_connection(connection_id, attempt, check, countdown=TURN_WAIT_SECONDS)


def _save_workers(connection_id: int, attempt: int, workers: dict) -> bool:
    return bool(
        VmConnection.objects.filter(
            pk=connection_id, attempt=attempt, state=ConnectionState.CONNECTING
        ).update(workers=workers)
    )


def check_connection(connection_id: int, attempt: int, check: int | None = None) -> None:
    """One look at every worker of a connecting VM with the lab's login, all at once:
    record each worker's answer, then end connected, or failed with the reason, or
    queue the next look with a countdown (soon at first, then every
    PORTAL_CONNECT_POLL_SECONDS) until PORTAL_CONNECT_WAIT_SECONDS after Connect.
    It never waits for the workers itself, and a lab's checks try workers one VM at a
    time (``_take_turn``), so a lab's Connects hold at most one Celery worker, however
    many there are and however long its workers take to answer."""
    turn = _take_turn(connection_id, attempt)
    if turn is None:
        return  # disconnected, connected, or connected again meanwhile
    if not turn:
        _wait_turn(connection_id, attempt, check)
        return
    try:
        connection = _claim(connection_id, attempt, check)
        if connection is not None:
            _look(connection)
    finally:
        VmConnection.objects.filter(pk=connection_id).update(looking_until=None)


def _look(connection: VmConnection) -> None:
    connection_id, attempt = connection.pk, connection.attempt
    vm = connection.vm
    login = login_for(vm.lab)
    workers = dict(connection.workers)
    rows = [
        row
        for row in sorted(vm.workers.all(), key=lambda w: w.index)
        if workers.get(str(row.index), {}).get("state") != ACCEPTED
    ]
    remotes = [
        RemoteWorker(
            address=row.external_ip or "",
            pins=HostKeyPins.parse(row.host_keys),
            name=row.alias,
            login=login,
        )
        for row in rows
    ]
    stop = ""
    # New connections: whether each worker accepts the lab's key now, not whether one
    # kept from before still works.
    outcomes = run_on_workers(remotes, "whoami.sh", keep=False)
    for row, outcome in zip(rows, outcomes, strict=True):
        if outcome.ok:
            workers[str(row.index)] = {"state": ACCEPTED, "detail": ""}
            continue
        error = outcome.error
        workers[str(row.index)] = {"state": REFUSED, "detail": str(error)[:300]}
        if error.kind in (RemoteError.HOST_KEY, RemoteError.NO_PIN) and not stop:
            stop = str(error)
    if stop:
        return _finish(connection_id, attempt, workers, stop)
    if not _save_workers(connection_id, attempt, workers):
        return  # disconnected or connected again meanwhile
    if all(w["state"] == ACCEPTED for w in workers.values()):
        return _finish(connection_id, attempt, workers, "")
    _look_again(connection, workers)


def _look_again(connection: VmConnection, workers: dict) -> None:
    """Queue the next look, or end the wait when the next would come too late."""
    looks = connection.checks  # this one included
    pause = min(
        float(settings.PORTAL_CONNECT_POLL_SECONDS),
        FIRST_PAUSE_SECONDS * 2 ** min(max(looks - 2, 0), 16),
    )
    now = timezone.now()
    deadline = connection.started_at + dt.timedelta(
        seconds=float(settings.PORTAL_CONNECT_WAIT_SECONDS)
    )
    if now + dt.timedelta(seconds=pause) > deadline:
        return _finish(connection.pk, connection.attempt, workers, WHY_REFUSED)
    if VmConnection.objects.filter(
        pk=connection.pk, attempt=connection.attempt, checks=looks
    ).update(next_check_at=now + dt.timedelta(seconds=pause)):
        queue.check_vm_connection(connection.pk, connection.attempt, looks, countdown=pause)


def confirmed_by_reconcile(vm_id: int) -> None:
    """A reconcile logged in on every worker with the lab's key and the pinned host
    keys, as the check does: the VM is connected (a check still looking stops at its
    next look), and no reconcile more is asked for, that one has just run."""
    connection = VmConnection.objects.filter(vm_id=vm_id, state=ConnectionState.CONNECTING).first()
    if connection is None:
        return
    workers = {str(i): {"state": ACCEPTED, "detail": ""} for i in connection.workers}
    _finish(connection.pk, connection.attempt, workers, "", reconciled=True)


def _finish(
    connection_id: int, attempt: int, workers: dict, reason: str, *, reconciled: bool = False
) -> None:
    state = ConnectionState.FAILED if reason else ConnectionState.CONNECTED
    with transaction.atomic():
        updated = VmConnection.objects.filter(
            pk=connection_id, attempt=attempt, state=ConnectionState.CONNECTING
        ).update(state=state, reason=reason, workers=workers, finished_at=timezone.now())
        if not updated:
            return
        connection = VmConnection.objects.select_related("vm__lab", "requested_by").get(
            pk=connection_id
        )
        vm = connection.vm
        audit.record(
            AuditAction.VM_CONNECT_FAILED if reason else AuditAction.VM_CONNECTED,
            actor=connection.requested_by,
            lab=vm.lab,
            summary=f"{vm.name}: {reason or 'every worker accepts the lab key'}",
            data={"vm": vm.pk, "workers": workers},
        )
        if not reason and not reconciled:
            # Nothing the workers must hold changed, so no new version: a reconcile
            # under way whose login was refused runs again by itself when it ends
            # (``reconcile.reconcile_vm``); this one runs when none is.
            queue.reconcile_vm(vm.pk)

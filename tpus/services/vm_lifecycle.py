"""Stopping, starting and deleting a lab's TPU VM through the Cloud TPU API.

The admin's click changes the VM's row and queues the call (``run``, a task); Google
takes minutes, and short tasks queued with a countdown look at its operation
(``follow``, a ``VmChange`` row), so that no task waits for it. Jobs are cancelled
cleanly first (the call waits until they ended on the workers, so each ends
``cancelled``, not lost with the machines), and a deletion tells everyone who had
access, once. Deleting needs the VM's name typed and says first what goes with it: who
has access, the jobs running and waiting, and everything in the homes on its workers.
A deleted VM is not brought back, even when it was kept alive.

A stopped VM holds none of the lab's allowance, so a start takes the chips again: it
is checked like a new request (``allowances.claim``, with the lab locked) and refused
with the numbers when they are no longer free or the lab's grant has ended.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from tpus import access, queue
from tpus.cloud import CloudError
from tpus.cloud.config import cloud_tpu
from tpus.cloud.operations import Started
from tpus.models import AuditAction, Grant, Job, TpuVm, VmChange, VmRequest
from tpus.models.grants import WANTED_STATES, GrantState
from tpus.models.inventory import NodeState, VmSource
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES
from tpus.models.provisioning import LabAllowance, Provisioning, chips_of
from tpus.services import allowances, emails, inventory, jobs
from tpus.services.hosts import hosts_must_change

log = logging.getLogger(__name__)

STOP, START, DELETE = "stop", "start", "delete"
# How often a stop or delete looks whether the jobs it cancelled have ended.
JOB_STOP_RECHECK_SECONDS = 2.0


@dataclass(frozen=True)
class Losses:
    """What deleting a VM takes with it."""

    people: list[str]  # unix usernames (or emails) of everyone with access
    running: int
    waiting: int
    workers: int


def losses(vm: TpuVm) -> Losses:
    people = [
        (g.user.unix_account.username if hasattr(g.user, "unix_account") else "") or g.user.email
        for g in Grant.objects.filter(vm=vm, state__in=WANTED_STATES).select_related(
            "user__unix_account"
        )
    ]
    return Losses(
        people=sorted(people),
        running=Job.objects.filter(vm=vm, state__in=ACTIVE_STATES).count(),
        waiting=Job.objects.filter(vm=vm, state__in=WAITING_STATES).count(),
        workers=vm.workers.count(),
    )


def _check(admin, vm: TpuVm) -> None:
    if not access.is_lab_admin(admin, vm.lab):
        raise PermissionDenied("Only the lab's admins can stop, start or delete its TPU VMs.")
    if vm.source == VmSource.MANUAL:
        raise ValidationError(
            f"{vm.name} was registered by hand: the portal cannot stop, start or delete it "
            "through the Cloud TPU API."
        )
    if vm.missing_since is not None:
        raise ValidationError(f"{vm.name} is no longer listed by Google Cloud.")


def _cancel_jobs(vm: TpuVm, by, reason: str) -> None:
    for job in Job.objects.filter(vm=vm, state__in=[*WAITING_STATES, *ACTIVE_STATES]):
        jobs.cancel_job(job, by, reason=reason)


def stop_vm(admin, vm: TpuVm, *, request=None) -> TpuVm:
    _check(admin, vm)
    if vm.state != NodeState.READY:
        raise ValidationError(
            f"{vm.name} is {vm.get_state_display().lower()}; only a ready VM stops."
        )
    return _change(admin, vm, STOP, NodeState.STOPPING, request=request)


def start_vm(admin, vm: TpuVm, *, request=None) -> TpuVm:
    _check(admin, vm)
    return _change(admin, vm, START, NodeState.STARTING, request=request)


def _may_start(vm: TpuVm) -> None:
    """A stopped VM holds none of the lab's allowance, so starting it takes its chips
    again: checked like a new request, with the lab locked (``allowances.claim``), and
    refused with the numbers when they are no longer free or the lab's grant ended. The
    VM's state is read again under the lock: of two starts at once, one goes."""
    if vm.state != NodeState.STOPPED:
        raise ValidationError(
            f"{vm.name} is {vm.get_state_display().lower()}; only a stopped VM starts."
        )
    # An imported VM of a generation and kind the lab has no allowance for: the lab
    # made it itself, outside any allowance the portal keeps, so only the grant's end
    # applies to it.
    kind = _provisioning(vm)
    grant_only = (
        vm.source != VmSource.CREATED
        and not LabAllowance.objects.filter(
            lab=vm.lab, generation=chips_of(vm.accelerator_type)[0], provisioning=kind
        ).exists()
    )
    try:
        allowances.claim(vm.lab, vm.accelerator_type, kind, grant_only=grant_only)
    except ValidationError as exc:
        why = f"{vm.name} cannot start: {exc.messages[0]}"
        if not allowances.grant_ended(vm.lab):
            why += (
                " A stopped VM holds none of the allowance: stop or delete another VM to "
                "make room, or ask a site admin to raise it."
            )
        raise ValidationError(why) from None


def _provisioning(vm: TpuVm) -> str:
    """The kind of chips the VM holds: as the portal asked for it, else (an imported
    VM) spot when Google may take it back."""
    asked = VmRequest.objects.filter(vm=vm).order_by("-pk").values_list("provisioning", flat=True)
    return asked.first() or (Provisioning.SPOT if vm.preemptible else Provisioning.ON_DEMAND)


def delete_vm(admin, vm: TpuVm, typed_name: str, *, request=None) -> TpuVm:
    _check(admin, vm)
    if typed_name.strip() != vm.name:
        raise ValidationError(f"Type the VM's name, {vm.name}, to delete it.")
    return _change(admin, vm, DELETE, NodeState.DELETING, request=request)


def _change(admin, vm: TpuVm, action: str, state: str, *, request=None) -> TpuVm:
    verb = {STOP: "stopped", START: "started", DELETE: "deleted"}[action]
    with transaction.atomic():
        # The VM's row and its lab's (the join is locked too, as a job's submit locks them).
        vm = TpuVm.objects.select_for_update().select_related("lab").get(pk=vm.pk)
        if action == START:
            _may_start(vm)
        else:
            _cancel_jobs(vm, admin, f"{vm.name} is being {verb} by the lab's admins.")
        if action == DELETE:
            # Deleted on purpose: never brought back by keep alive.
            VmRequest.objects.filter(vm=vm).update(keep_alive=False)
            emails.send_vm_deleted(vm.pk, admin.pk)
        TpuVm.objects.filter(pk=vm.pk).update(state=state)
        vm.state = state
        audit.record(
            {STOP: AuditAction.VM_STOP_REQUESTED, START: AuditAction.VM_START_REQUESTED,
             DELETE: AuditAction.VM_DELETE_REQUESTED}[action],
            actor=admin,
            lab=vm.lab,
            summary=vm.name,
            data={"vm": vm.pk},
            request=request,
        )  # fmt: skip
        queue.change_vm(vm.pk, action)
    return vm


def delete_idle_vm(vm: TpuVm, why: str) -> bool:
    """Delete a VM the portal made for itself (an elastic pool's) and no longer needs,
    through the same call and follow-up as an admin's deletion: only while no job is
    placed on it, starting or running there, read with the VM's and its lab's rows
    locked (the scheduler places with the lab's row locked, so a job placed meanwhile
    either came first and stops this, or waits and finds the VM deleting). No one is
    emailed: no one asked for the VM. True when the deletion was sent."""
    with transaction.atomic():
        vm = TpuVm.objects.select_for_update().select_related("lab").get(pk=vm.pk)
        if vm.missing_since is not None or vm.state in (NodeState.DELETING,):
            return False
        if Job.objects.filter(vm=vm, state__in=[*WAITING_STATES, *ACTIVE_STATES]).exists():
            return False
        VmRequest.objects.filter(vm=vm).update(keep_alive=False)
        TpuVm.objects.filter(pk=vm.pk).update(state=NodeState.DELETING)
        audit.record(
            AuditAction.VM_DELETE_REQUESTED,
            lab=vm.lab,
            summary=f"{vm.name}: {why}"[:300],
            data={"vm": vm.pk},
        )
        queue.change_vm(vm.pk, DELETE)
    return True


def jobs_still_stopping(vm: TpuVm) -> float | None:
    """Seconds until a stop or delete looks again, or None to go ahead: the jobs it
    cancelled are still being stopped on the workers (TERM, the grace period, then
    the job's cgroup killed), and the machines must outlive that for the job to end
    ``cancelled``, its owner told once. Waited for at most ``stop_wait`` after the
    cancel; past that, the VM goes and the job with it."""
    ending = Job.objects.filter(vm=vm, state__in=ACTIVE_STATES)
    since = min((j.cancel_requested_at or j.changed_at for j in ending), default=None)
    if since is None or timezone.now() - since > stop_wait():
        return None
    return JOB_STOP_RECHECK_SECONDS


def stop_wait() -> dt.timedelta:
    """How long a stop or delete waits for the jobs it cancelled: the grace period,
    two job polls and the pass's own stop."""
    return dt.timedelta(
        seconds=settings.PORTAL_JOB_CANCEL_GRACE_SECONDS + 2 * settings.PORTAL_JOB_POLL_SECONDS + 30
    )


def run(vm_id: int, action: str, *, may_wait: bool = True) -> float | None:
    """Send the call behind a stop, start or delete (for a VM made from a queued
    request, a deletion cancels the request first). Done at once, what follows in the
    lab happens now; otherwise the API's operation is looked at later (``follow``):
    no task waits for Google. A stop or delete first lets the jobs it cancelled end
    (``jobs_still_stopping``): then it returns the seconds after which to run it
    again, and calls nothing."""
    vm = TpuVm.objects.select_related("lab").filter(pk=vm_id).first()
    if vm is None:
        return None
    if may_wait and action in (STOP, DELETE):
        again = jobs_still_stopping(vm)
        if again is not None:
            # The job's pass ends it; make sure one runs soon, whatever the poll.
            queue.advance_jobs(vm.pk)
            return again
    client = cloud_tpu()
    try:
        if action == DELETE:
            queued = VmRequest.objects.filter(vm=vm).exclude(cloud_id="").order_by("-pk").first()
            if queued is not None:
                started = _gone_is_done(
                    lambda: client.begin_delete_queued_resource(
                        vm.lab.gcp_project_id, vm.zone, queued.cloud_id, with_node=True
                    )
                )
                if not started.done:
                    _look_later(vm, action, VmChange.Step.REQUEST, started.operation, client)
                    return None
        _send_node_call(vm, action, client)
    except CloudError as exc:
        _failed(vm, action, exc)
    return None


def _send_node_call(vm: TpuVm, action: str, client) -> None:
    project = vm.lab.gcp_project_id
    begin = {
        STOP: client.begin_stop_node,
        START: client.begin_start_node,
        DELETE: client.begin_delete_node,
    }[action]
    if action == DELETE:
        started = _gone_is_done(lambda: begin(project, vm.zone, vm.name))
    else:
        started = begin(project, vm.zone, vm.name)
    if started.done:
        _done(vm, action, started.node)
    else:
        _look_later(vm, action, VmChange.Step.NODE, started.operation, client)


def _gone_is_done(call) -> Started:
    """A deletion of something already gone is success."""
    try:
        return call()
    except CloudError as exc:
        if exc.code != "NOT_FOUND":
            raise
        return Started()


def _done(vm: TpuVm, action: str, node) -> None:
    """What follows a finished stop, start or deletion in the lab."""
    if action == STOP:
        inventory.refresh_from_node(vm, node)
    elif action == START:
        inventory.refresh_from_node(vm, node)
        hosts_must_change(vm, "started again")
    elif action == DELETE:
        _deleted(vm)


def _failed(vm: TpuVm, action: str, exc: CloudError) -> None:
    log.warning("%s %s: %s", action, vm, exc)
    audit.record(
        AuditAction.VM_CHANGE_FAILED,
        lab=vm.lab,
        summary=f"{vm.name}: {action} failed: {str(exc)[:300]}",
        data={"vm": vm.pk, "action": action, "code": exc.code},
    )
    # The next sync puts the VM's real state back on its row.
    queue.refresh_lab(vm.lab_id)


# -- following a change underway at Google ------------------------------------------------

# A look is presumed lost this long after it was due; the sweep queues it again.
LOST_AFTER_SECONDS = 60
METHODS = {
    (STOP, VmChange.Step.NODE): "StopNode",
    (START, VmChange.Step.NODE): "StartNode",
    (DELETE, VmChange.Step.NODE): "DeleteNode",
    (DELETE, VmChange.Step.REQUEST): "DeleteQueuedResource",
}


def _look_later(vm: TpuVm, action: str, step: str, operation: str, client) -> None:
    pause = client.next_look_in(0)
    change = VmChange.objects.create(
        vm=vm,
        action=action,
        step=step,
        operation=operation,
        claimed_until=timezone.now() + dt.timedelta(seconds=pause),
    )
    queue.follow_vm_change(change.pk, countdown=pause)


def _claim(change_id: int) -> VmChange | None:
    """Take the change's look (a conditional UPDATE): a look queued twice runs once."""
    now = timezone.now()
    lease = now + dt.timedelta(seconds=float(settings.TPU_API_TIMEOUT) + 30)
    taken = (
        VmChange.objects.filter(pk=change_id, finished_at=None)
        .filter(Q(claimed_until=None) | Q(claimed_until__lte=now))
        .update(claimed_until=lease)
    )
    return VmChange.objects.select_related("vm__lab").get(pk=change_id) if taken else None


def follow(change_id: int) -> None:
    """One look at a stop, start or deletion underway at Google: queue the next while
    it runs; once done, what follows in the lab (a deletion's second call, after the
    request's cancellation); failed, or still running after TPU_API_OPERATION_TIMEOUT,
    the same as a call that failed."""
    change = _claim(change_id)
    if change is None:
        return
    vm, client = change.vm, cloud_tpu()
    try:
        waited = (timezone.now() - change.started_at).total_seconds()
        method = METHODS[(change.action, change.step)]
        if change.action == DELETE:
            looked = _gone_is_done(
                lambda: client.look_at_operation(change.operation, waited=waited, method=method)
            )
        else:
            looked = client.look_at_operation(change.operation, waited=waited, method=method)
        if not looked.done:
            pause = client.next_look_in(waited)
            VmChange.objects.filter(pk=change.pk).update(
                claimed_until=timezone.now() + dt.timedelta(seconds=pause)
            )
            queue.follow_vm_change(change.pk, countdown=pause)
            return
        _finish(change)
        if change.step == VmChange.Step.REQUEST:
            _send_node_call(vm, DELETE, client)
        else:
            _done(vm, change.action, looked.node)
    except CloudError as exc:
        _finish(change)
        _failed(vm, change.action, exc)


def _finish(change: VmChange) -> None:
    VmChange.objects.filter(pk=change.pk).update(finished_at=timezone.now(), claimed_until=None)


def lost_changes() -> list[int]:
    """Changes still underway whose next look is long overdue (its task was lost)."""
    late = timezone.now() - dt.timedelta(seconds=LOST_AFTER_SECONDS)
    return list(
        VmChange.objects.filter(finished_at=None, claimed_until__lt=late)
        .order_by("pk")
        .values_list("pk", flat=True)
    )


def _deleted(vm: TpuVm) -> None:
    now = timezone.now()
    with transaction.atomic():
        TpuVm.objects.filter(pk=vm.pk).update(missing_since=now)
        # The machines are gone, and the accounts with them: nothing is left to revoke.
        Grant.objects.filter(vm=vm).exclude(state=GrantState.REVOKED).update(
            state=GrantState.REVOKED, changed_at=now, error=""
        )
        audit.record(AuditAction.VM_DELETED, lab=vm.lab, summary=vm.name, data={"vm": vm.pk})

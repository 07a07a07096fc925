"""The work behind a request for a TPU VM (``vm_requests`` takes the request): the call
it stands for, sent once; the looks at the long-running operation Google runs for it,
each a short task queued with a countdown, never a wait; the follow-up of a queued
request until capacity comes; and the VM's arrival in the lab, connected and pinned
(or, made anew after a preemption, restored: ``keep_alive``, ``made_anew``).
"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.cloud import CloudError, NodeInfo, NodeRequest
from tpus.cloud.config import cloud_tpu
from tpus.cloud.operations import Started, gone_is_done
from tpus.cloud.sshkeys import KeyLine
from tpus.models import AuditAction, Lab, TpuVm
from tpus.models.inventory import NodeState
from tpus.models.provisioning import (
    OPEN_REQUEST_STATES,
    VmRequest,
    VmRequestState,
)
from tpus.services import allowances, connect, emails, inventory, keep_alive, leases, made_anew
from tpus.services.labkeys import lab_key

log = logging.getLogger(__name__)

# How long past its window's end a request may still be waiting at Google before the
# portal cancels it there itself.
WINDOW_GRACE = dt.timedelta(minutes=5)


# --- the work behind a request --------------------------------------------------------


def _claim(request_id: int) -> dt.datetime | None:
    """Take the request (a conditional UPDATE): an open one, or one whose withdrawal at
    Google is still followed. The lease taken, or None when another task has it or a
    look at its operation is not due yet."""
    now = timezone.now()
    lease = now + leases.length()
    taken = (
        VmRequest.objects.filter(pk=request_id)
        .filter(Q(state__in=OPEN_REQUEST_STATES) | ~Q(operation=""))
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .update(claimed_until=lease)
    )
    return lease if taken else None


def _release(request_id: int, lease: dt.datetime) -> None:
    """Let go, unless a look at the request's operation was queued meanwhile (its due
    time replaced the lease)."""
    VmRequest.objects.filter(pk=request_id, claimed_until=lease).update(claimed_until=None)


def key_metadata(lab: Lab) -> dict[str, str]:
    """The node's metadata at creation: the lab's key line, as Connect would add it."""
    return {"ssh-keys": KeyLine(settings.PORTAL_LAB_SSH_USER, lab_key(lab).public_line).text}


def send(request_id: int) -> None:
    """Make the call a stored request stands for (once), then follow it: one short
    look each time, never a wait. A call Google runs as a long-running operation is
    kept on the row and looked at again by a task of its own, queued with a countdown
    (1 s, then further apart); the pass (``follow_open``) stands behind a lost one."""
    lease = _claim(request_id)
    if lease is None:
        return
    try:
        made = VmRequest.objects.select_related("lab").get(pk=request_id)
        if made.operation:
            _look(made)
        elif not made.is_open:
            pass
        elif made.state in (VmRequestState.REQUESTED, VmRequestState.WAITING) and (
            allowances.grant_ended(made.lab)
        ):
            _withdraw_after_grant_end(made)
        elif made.state == VmRequestState.REQUESTED:
            _send(made)
        else:
            _follow(made)
    finally:
        _release(request_id, lease)


def _withdraw_after_grant_end(made: VmRequest) -> None:
    """A request still waiting for capacity when the lab's TPU grant ends is withdrawn
    at Google and fails with the reason: no VM is made for a lab past its grant."""
    if made.cloud_id:
        try:
            _withdraw(made)
        except CloudError as exc:
            log.warning("request %s: not withdrawn yet: %s", made.pk, exc)
            return  # the next pass tries again
    _fail(
        made,
        "GRANT_ENDED",
        f"{made.name} was not made: the lab's TPU grant ended on "
        f"{made.lab.grant_end_date:%-d %B %Y} while it waited for capacity.",
    )


def _withdraw(made: VmRequest) -> None:
    """Send the deletion of the request's queued resource (and any node it made);
    Google still on it, its operation is followed (``_look``) while the request is
    failed at once. Gone already is success."""
    started = gone_is_done(
        lambda: cloud_tpu().begin_delete_queued_resource(
            made.lab.gcp_project_id, made.zone, made.cloud_id, with_node=True
        )
    )
    if not started.done:
        look_later(made, started.operation, DELETE_REQUEST)


def _wanted(made: VmRequest) -> NodeRequest:
    return NodeRequest(
        name=made.name,
        zone=made.zone,
        accelerator_type=made.accelerator_type,
        runtime_version=made.runtime_version,
        provisioning=made.provisioning,
        metadata=key_metadata(made.lab),
        # A VM asked for again comes back with the disks it had, in the modes it had.
        data_disks=keep_alive.disks_to_carry(made),
        valid_after=made.valid_after,
        valid_until=made.valid_until,
    )


def _send(made: VmRequest) -> None:
    """Clear the way (one deletion at a time, each looked at later while Google is on
    it), then send the create; what follows its end is ``_created``."""
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    try:
        if made.vm_id is not None:
            underway = keep_alive.clear_leftovers(made)
        elif made.queued:
            underway = _clear_failed_requests(made)
        else:
            underway = None
        if underway is not None:
            look_later(made, *underway)
            return
        if made.queued:
            cloud_id = made.cloud_id or f"{made.name}-{made.pk}"
            # Recorded before the call: a worker that dies after it never asks twice.
            VmRequest.objects.filter(pk=made.pk).update(cloud_id=cloud_id)
            made.cloud_id = cloud_id
            try:
                started = client.begin_create_queued_resource(project, cloud_id, _wanted(made))
            except CloudError as exc:
                if exc.code != "ALREADY_EXISTS":
                    raise
                started = Started()
            call = CREATE_REQUEST
        else:
            started = client.begin_create_node(project, _wanted(made))
            call = CREATE_NODE
    except CloudError as exc:
        _send_failed(made, exc)
        return
    VmRequest.objects.filter(pk=made.pk).update(sent_at=timezone.now())
    if started.done:
        _created(made, call, started.node)
    else:
        look_later(made, started.operation, call)


def _created(made: VmRequest, call: str, node: NodeInfo | None) -> None:
    """Google took the request: a queued one waits for capacity, a node is followed
    until it is up."""
    if call == CREATE_REQUEST:
        _set(made, VmRequestState.WAITING, waiting_since=timezone.now())
        _follow(made)
        return
    _set(made, VmRequestState.PROVISIONING)
    if node is None:
        _follow(made)
    else:
        _arrived(made, node)


def _send_failed(made: VmRequest, exc: CloudError) -> None:
    """A call to make the VM (or to clear its way) failed: a stockout of a direct
    create says to queue it; what may pass is sent again by the next pass; the rest
    fails the request with Google's reason."""
    if exc.code == "RESOURCE_EXHAUSTED" and not made.queued:
        _fail(
            made,
            exc.code,
            f"Google Cloud has no {made.accelerator_type} capacity in {made.zone} now. "
            "Ask again as a queued request, which waits until capacity comes.",
        )
    elif exc.retryable:
        log.warning("request %s: %s; the pass tries again", made.pk, exc)
    else:
        _fail(made, exc.code, str(exc))


# --- looking at an operation underway at Google -----------------------------------------

CREATE_NODE, CREATE_REQUEST = "CreateNode", "CreateQueuedResource"
DELETE_NODE, DELETE_REQUEST = "DeleteNode", "DeleteQueuedResource"
DELETIONS = (DELETE_NODE, DELETE_REQUEST)


def look_later(made: VmRequest, operation: str, call: str) -> None:
    """Keep the operation on the request and queue the first look at it (soon: a
    direct create that Google makes in seconds is up seconds later)."""
    pause = cloud_tpu().next_look_in(0)
    now = timezone.now()
    VmRequest.objects.filter(pk=made.pk).update(
        operation=operation,
        operation_call=call,
        operation_sent_at=now,
        claimed_until=now + dt.timedelta(seconds=pause),
    )
    made.operation, made.operation_call, made.operation_sent_at = operation, call, now
    queue.send_vm_request(made.pk, countdown=pause)


def _look(made: VmRequest) -> None:
    """One look at the request's operation: the next queued while Google is on it;
    done, what the call was for goes on; failed (or past TPU_API_OPERATION_TIMEOUT),
    as when the call itself failed."""
    client = cloud_tpu()
    call = made.operation_call
    waited = (timezone.now() - (made.operation_sent_at or timezone.now())).total_seconds()
    try:
        look = lambda: client.look_at_operation(made.operation, waited=waited, method=call)  # noqa: E731
        looked = gone_is_done(look) if call in DELETIONS else look()
    except CloudError as exc:
        if exc.method == "GetOperation" and exc.retryable:
            # The look failed, not the operation: look again later.
            log.warning("request %s: %s", made.pk, exc)
            looked = Started(operation=made.operation)
        else:
            _operation_over(made)
            _operation_failed(made, call, exc)
            return
    if not looked.done:
        pause = client.next_look_in(waited)
        VmRequest.objects.filter(pk=made.pk).update(
            claimed_until=timezone.now() + dt.timedelta(seconds=pause)
        )
        queue.send_vm_request(made.pk, countdown=pause)
        return
    _operation_over(made)
    if not made.is_open:
        return  # a withdrawal, done
    if call in DELETIONS:
        _send(made)  # the way is clearer: the next deletion, or the create
    else:
        _created(made, call, looked.node)


def _operation_over(made: VmRequest) -> None:
    VmRequest.objects.filter(pk=made.pk).update(
        operation="", operation_call="", operation_sent_at=None
    )
    made.operation = made.operation_call = ""


def _operation_failed(made: VmRequest, call: str, exc: CloudError) -> None:
    if made.is_open:
        _send_failed(made, exc)
        return
    # The request is over; what Google was asked to withdraw may still be there.
    log.warning("request %s: %s did not finish: %s", made.pk, call, exc)
    if made.state == VmRequestState.CANCELLED:
        VmRequest.objects.filter(pk=made.pk).update(
            error=f"Google Cloud did not cancel the request: {exc}"
        )


def follow_open() -> int:
    """The periodic pass: VMs kept alive that Google took back are asked for again,
    then every open request gets a look (and each withdrawal still followed: a look
    lost with its task is taken here)."""
    keep_alive.bring_back()
    ids = list(
        VmRequest.objects.filter(Q(state__in=OPEN_REQUEST_STATES) | ~Q(operation="")).values_list(
            "pk", flat=True
        )
    )
    for request_id in ids:
        queue.send_vm_request(request_id)
    return len(ids)


def _clear_failed_requests(made: VmRequest) -> tuple[str, str] | None:
    """Before a request is sent again (tried again after it failed or was cancelled):
    a failed or suspended queued resource of the same node name, which Google keeps
    until it is deleted, would hold the name. Nothing that holds a node is touched.
    The first deletion Google is still on is returned (operation, call), or None once
    the way is clear."""
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    for info in client.list_queued_resources(project, made.zone):
        if info.node_id == made.name and info.state in ("FAILED", "SUSPENDED"):
            started = gone_is_done(
                lambda name=info.name: client.begin_delete_queued_resource(
                    project, made.zone, name, with_node=False
                )
            )
            if not started.done:
                return started.operation, DELETE_REQUEST
    return None


def _follow(made: VmRequest) -> None:
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    if made.queued and made.cloud_id:
        try:
            info = client.get_queued_resource(project, made.zone, made.cloud_id)
        except CloudError as exc:
            if exc.code == "NOT_FOUND":
                _fail(made, exc.code, "Google Cloud no longer knows the request (deleted?).")
            else:
                log.warning("request %s: %s", made.pk, exc)
            return
        if info.state == "FAILED":
            _fail(made, info.error_code, _failure_text(made, info.error_code, info.error_message))
            return
        if info.state in ("ACCEPTED", "WAITING_FOR_RESOURCES", "CREATING"):
            if made.valid_until and timezone.now() > made.valid_until + WINDOW_GRACE:
                # Google should have failed it by now; nothing waits forever unseen.
                try:
                    _withdraw(made)
                except CloudError as exc:
                    log.warning("request %s: not withdrawn yet: %s", made.pk, exc)
                    return  # the next pass tries again
                _fail(made, "DEADLINE_EXCEEDED", _failure_text(made, "DEADLINE_EXCEEDED", ""))
            return
    try:
        node = client.get_node(project, made.zone, made.name)
    except CloudError as exc:
        if exc.code != "NOT_FOUND":
            log.warning("request %s: %s", made.pk, exc)
        return
    if made.state == VmRequestState.WAITING:
        _set(made, VmRequestState.PROVISIONING)
    _arrived(made, node)


def _failure_text(made: VmRequest, code: str, message: str) -> str:
    why = {
        "RESOURCE_EXHAUSTED": "Google Cloud ran out of capacity or quota for it",
        "DEADLINE_EXCEEDED": "capacity did not come before the end of its window",
        "INVALID_ARGUMENT": "Google Cloud refused what it asks for",
        "PERMISSION_DENIED": "the portal's service account may not create TPU VMs in the "
        "lab's project (it needs roles/tpu.admin)",
    }.get(code, "Google Cloud failed it")
    return f"{made.name} was not made: {why}. {message}".strip()


def _arrived(made: VmRequest, node: NodeInfo) -> None:
    """A node is there: once READY, put it in the lab, connected, pinned, reconciled."""
    if node.state != NodeState.READY or not all(w.external_ip for w in node.workers):
        return
    # One transaction: the reconcile that registering the VM asks for starts once the
    # VM is marked connecting, so a worker that has not taken the lab's key yet is
    # looked at again soon, not failed.
    with transaction.atomic():
        if made.vm_id is not None:
            # The VM is made anew: its workers have new host keys, as a new VM does.
            # That is expected here, not an alarm: the pins are dropped and taken again
            # from what the new workers publish, before anyone has a shell on them. (A
            # changed key on a VM that was not made anew still stops provisioning and
            # alerts the admins.)
            made_anew.forget_host_keys(made.vm)
        vm = inventory.register_created(made.lab, node, requested_by=made.requested_by)
        connect.wait_for_workers(vm, made.requested_by)
        if made.vm_id is not None:
            keep_alive.run_again_what_it_lost(made)
        if made.vm_id is not None and (vm.grants.exists() or vm.attachments.exists()):
            # Whole again once every worker has what the new machines need (accounts,
            # the disks mounted): jobs wait for it and people are told then
            # (``settle_grants``), so that the email's "log in as before" is true when
            # it arrives.
            TpuVm.objects.filter(pk=vm.pk).update(restore_version=F("desired_version"))
        VmRequest.objects.filter(pk=made.pk).update(
            state=VmRequestState.READY, vm=vm, ready_at=timezone.now(), changed_at=timezone.now()
        )
        audit.record(
            AuditAction.VM_CREATED,
            lab=made.lab,
            summary=f"{vm.name} ({vm.accelerator_type}, {vm.workers.count()} workers) is up",
            data={"request": made.pk, "vm": vm.pk},
        )


def _set(made: VmRequest, state: str, **fields) -> None:
    VmRequest.objects.filter(pk=made.pk).update(state=state, changed_at=timezone.now(), **fields)
    made.state = state


def _fail(made: VmRequest, code: str, text: str) -> None:
    with transaction.atomic():
        updated = VmRequest.objects.filter(pk=made.pk, state__in=OPEN_REQUEST_STATES).update(
            state=VmRequestState.FAILED, error_code=code, error=text, changed_at=timezone.now()
        )
        if updated:
            emails.send_vm_request_failed(made.pk)
            audit.record(
                AuditAction.VM_REQUEST_FAILED,
                lab=made.lab,
                summary=f"{made.name} in {made.zone}: {text[:300]}",
                data={"request": made.pk, "code": code},
            )
    made.state = VmRequestState.FAILED

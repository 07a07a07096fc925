"""The one place that hands work to Celery: one function per kind of work, each
queued only once the current transaction commits (at once outside a transaction),
so no worker acts on a change that rolled back, or reads a row before it exists.

No task waits on the outside world (a worker that has not accepted a key yet): it
looks once and, when it must look again, queues itself with a countdown, keeping its
place (a count, a deadline) in the database row, so one lab's waits never hold the
workers another lab's sync, revoke or job start needs.

Tasks are named, not imported (as Zulip names its queues): the tasks call the
services, and the services call this module, so importing the tasks here would tie
the two into one knot. Tasks carry ids; they reload and re-check what they are given.
The task modules are imported once, at start-up, by their apps' ``ready()``, so every
name below resolves in any process (web, worker, shell) from the first call on,
whichever threads make it.

Queuing happens after the change committed, so it must not undo or hide that change:
when the broker cannot take the task, the failure is logged and the caller carries on
(a web request still answers as if it had worked). The periodic sweeps
(``tpus.services.maintenance``) find the work the lost task stood for and queue it
again. ``check_tpu_usage`` is the one kind no sweep stands behind: it changes
nothing, it only looks, and whatever wants the answer asks again.

Emails are not queued work: each is written to the outbox (``tpus.services.emails``)
in the transaction of the change it tells of, and the outbox delivers it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from contextlib import contextmanager

from django.db import transaction

from portal.celery import app

logger = logging.getLogger(__name__)


def _send(name: str, *args, countdown: float | None = None) -> None:
    """Hand one task to the broker (to run ``countdown`` seconds from now, when given).
    Where tasks run in-process (eager), the task runs here and its own errors are
    raised; otherwise nothing is raised: a broker that cannot take the task is logged,
    and the sweep queues the work again."""
    if app.conf.task_always_eager:
        _run_in_process(name, args, countdown)
        return
    try:
        app.tasks[name].apply_async(args, countdown=countdown)
    except Exception:
        logger.exception(
            "could not queue %s%r; the periodic sweep will queue the work again", name, args
        )


_in_process = threading.local()


def _run_in_process(name: str, args: tuple, countdown: float | None) -> None:
    """Eager tasks run in this process as they are queued; one queued for later (a
    re-check) runs once the task that queued it has returned and its countdown is
    over, as a worker would run it: one after another, never inside the task that
    queued it, so a check that looks again a hundred times does not nest a hundred
    deep."""
    later = getattr(_in_process, "later", None)
    outermost = later is None
    if outermost:
        _in_process.later = later = []
    try:
        if countdown:
            heapq.heappush(later, (time.monotonic() + countdown, next(_order), name, args))
        else:
            app.tasks[name].apply_async(args)
        while outermost and later:
            due, _, due_name, due_args = heapq.heappop(later)
            time.sleep(max(0.0, due - time.monotonic()))  # in-process: nothing else waits
            app.tasks[due_name].apply_async(due_args)
    finally:
        if outermost:
            _in_process.later = None


_order = itertools.count()


def _on_commit(name: str, *args, countdown: float | None = None) -> None:
    transaction.on_commit(lambda: _send(name, *args, countdown=countdown))


# Hosts


def reconcile_vm(vm_id: int) -> None:
    """Make every worker of the VM match the database (inside ``reconciles_gathered``,
    once for all the changes made there)."""
    gathered = getattr(_gathering, "vm_ids", None)
    if gathered is not None:
        gathered[vm_id] = None
        return
    _on_commit("tpus.tasks.reconcile_vm", vm_id)


_gathering = threading.local()


@contextmanager
def reconciles_gathered():
    """Within it, the reconciles asked for are gathered and each VM's is queued once,
    on the way out (after commit, as always): several people given one VM at once
    cost it one reconcile, which reads the VM's whole desired state when it runs.
    Leaving by an exception queues nothing: use it inside the transaction whose
    changes the reconciles are for, so that they roll back together."""
    if getattr(_gathering, "vm_ids", None) is not None:
        yield  # an outer one queues them
        return
    _gathering.vm_ids = gathered = {}
    try:
        yield
    finally:
        _gathering.vm_ids = None
    for vm_id in gathered:
        _on_commit("tpus.tasks.reconcile_vm", vm_id)


def recheck_disks(vm_id: int, seconds: float) -> None:
    """Look again, ``seconds`` from now, at the VM's disks its workers wait for (the
    beat task ``disk-recheck`` stands behind it)."""
    _on_commit("tpus.tasks.recheck_vm_disks", vm_id, countdown=max(seconds, 0.0))


def run_disk_operation(operation_id: int, *, countdown: float | None = None) -> None:
    """Attach or detach a disk through the Cloud TPU API (or look how it goes)."""
    _on_commit("tpus.tasks.run_disk_operation", operation_id, countdown=countdown)


def check_vm_connection(
    connection_id: int, attempt: int, check: int, *, countdown: float | None = None
) -> None:
    """Look once whether every worker of a VM accepts the lab's key (one check of one
    attempt; the check queues the next itself while the workers are not there yet)."""
    _on_commit("tpus.tasks.check_vm_connection", connection_id, attempt, check, countdown=countdown)


def scan_host_keys(scan_id: int) -> None:
    """Read the host keys a worker offers, for an admin to confirm."""
    _on_commit("tpus.tasks.scan_worker_host_keys", scan_id)


def send_vm_request(request_id: int, *, countdown: float | None = None) -> None:
    """Ask Google Cloud for a requested TPU VM, or look again how the request goes
    (``countdown`` seconds from now: the next look at its operation)."""
    _on_commit("tpus.tasks.send_vm_request", request_id, countdown=countdown)


def change_vm(vm_id: int, action: str) -> None:
    """Stop, start or delete a TPU VM through the Cloud TPU API."""
    _on_commit("tpus.tasks.change_vm", vm_id, action)


def follow_vm_change(change_id: int, *, countdown: float | None = None) -> None:
    """Look how a VM's stop, start or deletion goes at Google."""
    _on_commit("tpus.tasks.follow_vm_change", change_id, countdown=countdown)


def advance_jobs(vm_id: int) -> None:
    """One pass over the VM's jobs: poll the running one, start the next in line."""
    _on_commit("tpus.tasks.advance_jobs", vm_id)


def check_tpu_usage(vm_id: int) -> None:
    """Look at who holds the VM's chips (for "who is using this TPU now")."""
    _on_commit("tpus.tasks.check_tpu_usage", vm_id)


def refresh_lab(lab_id: int) -> None:
    """List one lab's TPU VMs from the Cloud TPU API now."""
    _on_commit("tpus.tasks.sync_lab_inventory", lab_id)


def check_elastic_pool(
    lab_id: int, accelerator_type: str, *, countdown: float | None = None
) -> None:
    """Look at the lab's elastic pool of a kind (grow it for jobs no VM takes, let go
    of its idle VMs), if it has one switched on."""
    _on_commit("tpus.tasks.check_elastic_pool", lab_id, accelerator_type, countdown=countdown)

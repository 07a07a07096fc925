"""Work on a VM's workers: reconcile them, look whether Connect is done, run a disk
operation, scan a worker's host keys."""

from __future__ import annotations

from tpus.services import connect, disk_operations, hostkey_scans, reconcile
from tpus.tasks.naming import task

# Backoff for workers that could not be reached: 2, 4, 8 … seconds (with jitter), then
# the grants fail and the admins hear of it; the periodic sweep keeps trying later.
RECONCILE_RETRIES = 6


@task(bind=True, ignore_result=True, max_retries=RECONCILE_RETRIES)
def reconcile_vm(self, vm_id: int) -> None:
    """Make every worker of a VM match the database, and start the pool jobs its
    settle placed there (see tpus.services.reconcile)."""
    if not reconcile.worth_running(vm_id, retried=bool(self.request.retries)):
        return
    report = reconcile.reconcile_and_start(vm_id)
    if report.busy or not report.retryable:
        return
    # Run in-process (no broker to come back through), or out of retries: the grants
    # fail with the reason now; the periodic sweep keeps trying the VM later.
    if self.request.is_eager or self.request.retries >= self.max_retries:
        reconcile.give_up(vm_id)
        return
    raise self.retry(countdown=reconcile.next_try_in(report, self.request.retries))


@task(ignore_result=True)
def check_vm_connection(connection_id: int, attempt: int, check: int | None = None) -> None:
    """Look once whether every worker of a VM accepts the lab's key; the look queues
    the next itself (``check`` counts them; ``None`` from an earlier version)."""
    connect.check_connection(connection_id, attempt, check)


@task(ignore_result=True)
def run_disk_operation(operation_id: int) -> None:
    """Attach or detach a disk through the API: one step (send the change, or look at
    its long-running operation); the step queues the next look itself."""
    disk_operations.run_operation(operation_id)


@task(ignore_result=True)
def scan_worker_host_keys(scan_id: int) -> None:
    """Read the host keys a worker offers, for an admin to confirm."""
    hostkey_scans.run_scan(scan_id)

"""Celery tasks: thin wrappers that take ids, reload, check the row still calls for
the work, and call a service. They are queued only through ``tpus.queue``."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError

from portal import heartbeat
from portal.celery import every
from tpus.models import Lab, TpuVm
from tpus.services import (
    connect,
    disk_operations,
    emails,
    grants,
    hostkey_scans,
    jobs,
    maintenance,
    reconcile,
    sync,
)

# Mail itself never fails a task (the outbox retries delivery for hours); this covers
# a task that could not read its rows or store its message (the database briefly gone).
RETRY = {
    "autoretry_for": (OSError, InterfaceError, OperationalError),
    "retry_backoff": 2,
    "retry_backoff_max": 300,
    "retry_jitter": True,
    "max_retries": 6,
}
# Backoff for workers that could not be reached: 2, 4, 8 … seconds (with jitter), then
# the grants fail and the admins hear of it; the periodic sweep keeps trying later.
RECONCILE_RETRIES = 6


@every(settings.PORTAL_HEARTBEAT_SECONDS, name="heartbeat")
@shared_task(ignore_result=True)
def record_heartbeat() -> None:
    """Proves beat and a worker are both running (shown to site admins)."""
    heartbeat.beat()


@every(settings.PORTAL_SYNC_SECONDS, name="sync-inventory")
@shared_task(ignore_result=True)
def sync_inventory() -> None:
    """Refresh every lab's TPU VMs: one ListNodes per (project, zone)."""
    sync.sync_inventory()


@shared_task(ignore_result=True)
def sync_lab_inventory(lab_id: int) -> None:
    lab = Lab.objects.filter(pk=lab_id).first()
    if lab is not None:
        sync.sync_inventory([lab])


@shared_task(bind=True, ignore_result=True, max_retries=RECONCILE_RETRIES)
def reconcile_vm(self, vm_id: int) -> None:
    """Make every worker of a VM match the database (see tpus.services.reconcile)."""
    if not TpuVm.objects.filter(pk=vm_id).exists():
        return
    report = reconcile.reconcile_vm(vm_id)
    if report.busy or not report.retryable:
        return
    # Run in-process (no broker to come back through), or out of retries: the grants
    # fail with the reason now; the periodic sweep keeps trying the VM later.
    if self.request.is_eager or self.request.retries >= self.max_retries:
        reconcile.give_up(vm_id)
        return
    raise self.retry(countdown=reconcile.unreachable_retry_delay(self.request.retries))


@shared_task(ignore_result=True)
def check_vm_connection(connection_id: int, attempt: int) -> None:
    """Wait (bounded) until every worker of a VM accepts the lab's key."""
    connect.check_connection(connection_id, attempt)


@shared_task(ignore_result=True)
def run_disk_operation(operation_id: int) -> None:
    """Attach or detach a disk through the API's long-running operation."""
    disk_operations.run_operation(operation_id)


@every(settings.PORTAL_RECONCILE_SWEEP_SECONDS, name="reconcile-sweep")
@shared_task(ignore_result=True)
def reconcile_sweep() -> None:
    """Queue again whatever is stuck or lost, and reconcile every VM now and then so
    drift is found and mended."""
    maintenance.requeue_stuck_work()


@every(settings.PORTAL_STALLED_CHECK_SECONDS, name="release-stalled-claims")
@shared_task(ignore_result=True)
def release_stalled_claims() -> None:
    """Run again now the reconciles and disk operations whose holder died."""
    maintenance.rerun_stalled_claims()


@every(settings.PORTAL_EXPIRY_CHECK_SECONDS, name="expire-grants")
@shared_task(ignore_result=True)
def expire_grants() -> None:
    """Revoke expired grants; warn people a week before their access ends."""
    grants.expire_grants()
    grants.warn_expiring_grants()


# The emails: each service function reloads its rows, re-checks that the news still
# holds, and stores the message in the outbox (tpus.services.emails).
def _email_task(service):
    return shared_task(name=f"tpus.tasks.{service.__name__}", **RETRY)(service)


send_membership_email = _email_task(emails.send_membership_email)
send_invite_email = _email_task(emails.send_invite_email)
send_grant_email = _email_task(emails.send_grant_email)
send_host_key_alert = _email_task(emails.send_host_key_alert)
send_sync_alert = _email_task(emails.send_sync_alert)
send_ip_change_email = _email_task(emails.send_ip_change_email)
send_drift_alert = _email_task(emails.send_drift_alert)
send_job_email = _email_task(emails.send_job_email)


@shared_task(ignore_result=True)
def scan_worker_host_keys(scan_id: int) -> None:
    """Read the host keys a worker offers, for an admin to confirm."""
    hostkey_scans.run_scan(scan_id)


@shared_task(ignore_result=True)
def advance_jobs(vm_id: int) -> None:
    """Poll the VM's running job and start the next one in line."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        jobs.advance(vm_id)


@every(settings.PORTAL_JOB_POLL_SECONDS, name="poll-jobs")
@shared_task(ignore_result=True)
def poll_jobs() -> None:
    """Every VM with a job running or waiting gets a pass of its own."""
    jobs.poll_all()


@shared_task(ignore_result=True)
def check_tpu_usage(vm_id: int) -> None:
    """Who holds the VM's chips now, for its page and the lab's usage page."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        jobs.check_usage(vm_id)

"""The one verb for "these hosts must change".

Desired state lives in the database; the reconciler of a TPU VM makes every worker
match it. Whatever changed what a VM's hosts must look like (a grant, a person's keys,
a disk, a new address, a reboot, a re-pinned host key, a VM that now accepts the lab's
key) ends here: the VM's desired version goes up, and a reconcile is queued for when
the change commits. Reconciling is idempotent, so asking too often is harmless;
forgetting to ask is not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db.models import F, Q

from tpus import queue
from tpus.models import TpuVm, Worker
from tpus.models.inventory import worker_alias
from tpus.remote import HostKeyPins, Login, forget_kept
from tpus.remote import Worker as RemoteWorker

log = logging.getLogger(__name__)


def hosts_must_change(vm: TpuVm, reason: str) -> int:
    """Record that ``vm``'s workers must change (``reason`` says why, for the log) and
    reconcile them once the current transaction commits. Returns the new desired
    version, which a grant records as the version that carries its change."""
    TpuVm.objects.filter(pk=vm.pk).update(desired_version=F("desired_version") + 1)
    vm.refresh_from_db(fields=["desired_version"])
    log.info("%s must change (version %s): %s", vm, vm.desired_version, reason)
    queue.reconcile_vm(vm.pk)
    return vm.desired_version


@dataclass(frozen=True)
class StoppedWorker:
    """A worker the portal cannot provision now: ``why`` for the lab's admins,
    ``what`` in a few words for the people who use the VM."""

    alias: str
    what: str
    why: str


# Workers whose provisioning is stopped (see ``stopped_workers``), as a filter.
STOPPED = Q(host_key_mismatch_at__isnull=False, host_key_alarm_published=False) | Q(
    sync__last_error_retryable=False, sync__last_error__gt=""
)


def stopped_workers(vm: TpuVm) -> list[StoppedWorker]:
    """The workers of ``vm`` whose provisioning is stopped, in one query: one that
    presented a host key other than the pinned one (nothing is sent to it until it
    presents the pinned key again or an admin re-pins), and one whose last reconcile
    failed for a reason a retry does not mend (its grants fail with it). A worker
    that is only unreachable for now, or whose alarm is about published keys only, is
    still provisioned."""
    rows = (
        Worker.objects.filter(vm_id=vm.pk)
        .filter(STOPPED)
        .order_by("index")
        .values("index", "host_key_mismatch_at", "host_key_alarm_published", "sync__last_error")
    )
    stopped = []
    for row in rows:
        alias = worker_alias(vm.name, row["index"])
        if row["host_key_mismatch_at"] and not row["host_key_alarm_published"]:
            what = "host key alarm"
            why = "it presented a host key that is not the pinned one; review it"
        else:
            what = "provisioning failed"
            why = row["sync__last_error"] or "its last reconcile failed"
        stopped.append(StoppedWorker(alias, what, why))
    return stopped


def remote_worker(worker: Worker, login: Login) -> RemoteWorker:
    """How the remote door reaches a worker: its current address, its pinned host
    keys, the given login (the VM's lab's key, ``labkeys.login_for``)."""
    return RemoteWorker(
        address=worker.external_ip or "",
        pins=HostKeyPins.parse(worker.host_keys),
        name=worker.alias,
        login=login,
        generation=worker.ssh_generation,
    )


def forget_connections(workers) -> None:
    """The portal forgot how it reached these workers (a ``Worker`` queryset): an SSH
    connection kept open to one of them is never used again, in any process (their
    generation goes up), and this process closes its own now."""
    addresses = [a for a in workers.values_list("external_ip", flat=True) if a]
    workers.update(ssh_generation=F("ssh_generation") + 1)
    for address in addresses:
        forget_kept(address)

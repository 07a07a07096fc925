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

from django.db.models import F

from tpus import queue
from tpus.models import TpuVm, Worker
from tpus.remote import HostKeyPins, Login
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


def remote_worker(worker: Worker, login: Login) -> RemoteWorker:
    """How the remote door reaches a worker: its current address, its pinned host
    keys, the given login (the VM's lab's key, ``labkeys.login_for``)."""
    return RemoteWorker(
        address=worker.external_ip or "",
        pins=HostKeyPins.parse(worker.host_keys),
        name=worker.alias,
        login=login,
    )

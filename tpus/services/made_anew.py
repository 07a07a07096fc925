"""A TPU VM whose node Google made anew (after a preemption, by a queued resource, or a
request of the portal's) runs on new machines with new host keys, often at the same
addresses. That is expected, not an alarm: the node's creation time, as the Cloud TPU
API reports it, is after the moment its workers' keys were pinned, so those pins
belong to machines that are gone. Their pins are dropped and taken again from what the
new workers publish (guest attributes, as at import), and the VM is set up again
(accounts, disks; jobs wait until it is whole, and its people hear it is back).

Whoever learns it first acts: the sync (it lists the node with its new creation time),
the request that made it, or a connection that met an unknown host key (the reconcile,
the job poll), which asks the API with one GetNode before raising any alarm. A worker
that presents another key while its node was **not** made anew still stops and alarms
the admins (``hostkey_alarms``): its node's creation time is before its pins.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.db.models import F

from portal import audit
from tpus.cloud import CloudError, NodeInfo
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction, ConnectionState, TpuVm, VmConnection, Worker
from tpus.models.inventory import API_SOURCES, HostKeySource, NodeState
from tpus.services import connect, inventory, kind_grants
from tpus.services.hosts import forget_connections, hosts_must_change

log = logging.getLogger(__name__)

# Two creation times from the API differ by this much or more: another node (the
# API's nanoseconds are not stored).
SLACK = dt.timedelta(seconds=1)
# A pin taken this long or more before the node's creation (the portal's clock against
# Google's) was taken on other machines. Wide, so that no clock skew makes a node's own
# pins look old; a node made again minutes after its pins is caught by the first test.
CLOCKS_SLACK = dt.timedelta(seconds=60)
# How long after a node's creation the sync still looks for the keys of its workers
# that had published none yet.
LATE_KEYS_WINDOW = dt.timedelta(minutes=15)


def pins_predate(vm: TpuVm, created: dt.datetime | None) -> bool:
    """Whether the node created at ``created`` is newer than the VM's pins: newer than
    the node the portal recorded, or than the moment a worker was pinned. (A pin of
    unknown age counts as this node's: a changed key there still alarms.)"""
    if created is None:
        return False
    if vm.node_created_at is not None and created - vm.node_created_at >= SLACK:
        return True
    return any(
        w.host_keys_pinned_at is not None and created - w.host_keys_pinned_at >= CLOCKS_SLACK
        for w in vm.workers.all()
        if w.is_pinned
    )


def recognise(vm: TpuVm, node: NodeInfo | None = None) -> bool:
    """If the VM's node was made after its workers' keys were pinned (asked of the API
    with one GetNode unless ``node`` is given), re-pin the workers from what the new
    machines publish and set the VM up again; True then. False (and nothing changed)
    for a node that was not made anew, is not up yet, or could not be read. Addresses
    are left to the sync, which tells people of those that moved."""
    if vm.missing_since is not None or vm.source not in API_SOURCES:
        return False  # a VM registered by hand: the API knows nothing of it
    if node is None:
        try:
            node = cloud_tpu().get_node(vm.lab.gcp_project_id, vm.zone, vm.name)
        except CloudError as exc:
            log.warning("cannot ask whether %s was made anew: %s", vm, exc)
            return False
    if node.state != NodeState.READY:
        return False
    with transaction.atomic():
        vm = TpuVm.objects.select_for_update().select_related("lab").get(pk=vm.pk)
        if not pins_predate(vm, node.create_time):
            return False  # not made anew, or someone took the pins again meanwhile
        forget_host_keys(vm)
        TpuVm.objects.filter(pk=vm.pk).update(node_created_at=node.create_time)
        audit.record(
            AuditAction.HOST_KEYS_PINNED,
            lab=vm.lab,
            summary=f"{vm.name} was made anew on new machines: host keys taken again "
            "from what they publish, no alarm",
            data={"vm": vm.pk, "node_created": node.create_time.isoformat()},
        )
    try:
        inventory.pin_from_guest_attributes(vm, node)
    except CloudError as exc:
        log.warning("guest attributes of %s unavailable: %s", vm, exc)
    with transaction.atomic():
        hosts_must_change(vm, "made anew on new machines")
        if VmConnection.objects.filter(
            vm=vm, state__in=(ConnectionState.CONNECTED, ConnectionState.CONNECTING)
        ).exists():
            # The new machines' guest agents put the lab's key (the node's ssh-keys)
            # in place seconds after boot: wait for it as for a new VM, so a worker
            # not taking it yet is looked at again, with no alarm.
            connect.wait_for_workers(vm, None)
        if vm.grants.exists() or vm.attachments.exists():
            # Whole again once every worker has the accounts and mounts: jobs wait,
            # and the people with access hear it then (``reconcile.settle_grants``).
            TpuVm.objects.filter(pk=vm.pk).update(restore_version=F("desired_version"))
    # A kind grant given while the VM could not take it (its workers unpinned).
    kind_grants.apply_kind_grants(vm)
    log.info("%s was made anew (node created %s): pins taken again", vm, node.create_time)
    return True


def may_have_late_workers(vm: TpuVm, node: NodeInfo, now: dt.datetime) -> bool:
    """Whether the sync should look for keys of workers that published none yet: a
    ready node made in the last ``LATE_KEYS_WINDOW`` with a worker still unpinned.
    (Guest agents publish within a minute of boot; an older unpinned worker is one
    whose keys the API does not publish, for an admin to confirm: no call each sync.)"""
    return (
        node.state == NodeState.READY
        and node.create_time is not None
        and now - node.create_time < LATE_KEYS_WINDOW
        and any(not w.is_pinned for w in vm.workers.all())
    )


def pin_late_workers(vm: TpuVm, node: NodeInfo) -> bool:
    """Pin, from what they publish now, the workers of the VM's node that had published
    no host keys yet when it was pinned (a node made anew whose guest agents had not
    written them, a worker that booted late). Nobody can have a shell on an unpinned
    worker (the portal never connects to one), so this is the moment of import for it.
    True when a worker was pinned: the VM is set up again, accounts and disks included.
    """
    waiting = {w.pk for w in vm.workers.all() if not w.is_pinned}
    if not waiting:
        return False
    try:
        inventory.pin_from_guest_attributes(vm, node)
    except CloudError as exc:
        log.warning("guest attributes of %s unavailable: %s", vm, exc)
        return False
    pinned = list(
        Worker.objects.filter(pk__in=waiting).exclude(host_keys=[]).values_list("index", flat=True)
    )
    if not pinned:
        return False
    with transaction.atomic():
        audit.record(
            AuditAction.HOST_KEYS_PINNED,
            lab=vm.lab,
            summary=f"{vm.name}: host keys of worker {', '.join(map(str, sorted(pinned)))} "
            "taken from what they publish now",
            data={"vm": vm.pk, "workers": sorted(pinned)},
        )
        hosts_must_change(vm, "late workers pinned")
    kind_grants.apply_kind_grants(vm)
    return True


def forget_host_keys(vm: TpuVm) -> None:
    """Drop the pins (and any alarm) of every worker of a VM made anew."""
    forget_connections(Worker.objects.filter(vm=vm))
    Worker.objects.filter(vm=vm).update(
        host_keys=[],
        host_keys_source=HostKeySource.NONE,
        host_keys_pinned_at=None,
        host_keys_pinned_by=None,
        host_key_mismatch_at=None,
        presented_host_key="",
        host_key_alarm_published=False,
        host_key_alerted_at=None,
        published_host_keys=[],
        published_keys_checked_at=None,
        published_keys_recheck=False,
    )

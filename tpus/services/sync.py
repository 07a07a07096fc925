"""Keeping the inventory current: one ListNodes per (project, zone) across every lab,
then each registered VM is updated from what was listed.

The beat's tick only queues one task per lab (``sync_every_lab``); each lists its own
lab's zones (``sync_lab``), one such task per lab at a time (a lease on the lab's
row). So one lab's zone that hangs or fails (a call's timeout, three tries) delays
that lab's listing only: every other lab's, and its IP-change emails, go on beside it.

A zone whose listing failed is left exactly as it was: a transient API error never
marks a VM missing or changes an address. How each zone's listing went is recorded
for the lab's pages, API and admins (``sync_health``). Then the host keys the API
publishes are compared with the pins for the VMs that have a reason and a few more
(``published_keys``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.cloud import CloudError, NodeInfo
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction, IpChange, Job, Lab, Worker
from tpus.models.inventory import API_SOURCES, NodeHealth, NodeState, TpuVm
from tpus.models.jobs import ACTIVE_STATES
from tpus.services import (
    ipchanges,
    job_engine,
    leases,
    made_anew,
    published_keys,
    sync_health,
)
from tpus.services.inventory import apply_node

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    listed: int = 0
    updated: int = 0
    ip_changes: int = 0
    missing: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # "project/zone" -> message
    # VMs whose published host keys must be compared now (new address, came back,
    # re-created), and the workers found with a published key change.
    keys_due: set[int] = field(default_factory=set)
    listed_vms: set[int] = field(default_factory=set)
    host_key_changes: list = field(default_factory=list)


def _pairs(labs) -> dict[tuple[str, str], list[Lab]]:
    pairs: dict[tuple[str, str], list[Lab]] = defaultdict(list)
    for lab in labs:
        for zone in lab.zones:
            pairs[(lab.gcp_project_id, zone)].append(lab)
    return pairs


def sync_every_lab() -> int:
    """The beat's tick: queue each lab's own sync (one query, no API call)."""
    ids = list(Lab.objects.order_by("pk").values_list("pk", flat=True))
    for lab_id in ids:
        queue.refresh_lab(lab_id)
    return len(ids)


def sync_lab(lab_id: int) -> SyncReport | None:
    """List one lab's zones and update its VMs, unless another task does so now (then
    None: the running one lists them now). The lease is renewed while the lab's zones
    are listed, so a task that died is replaced within one lease."""
    now = timezone.now()
    rows = Lab.objects.filter(pk=lab_id)
    taken = rows.filter(Q(sync_claimed_until__isnull=True) | Q(sync_claimed_until__lt=now)).update(
        sync_claimed_until=now + leases.length()
    )
    if not taken:
        return None
    try:
        with leases.Heartbeat(rows, "sync_claimed_until", "lab's sync lease"):
            return sync_inventory(list(rows))
    finally:
        rows.update(sync_claimed_until=None)


def sync_inventory(labs=None) -> SyncReport:
    """Refresh the registered VMs of ``labs`` (all labs by default)."""
    report = SyncReport()
    labs = list(Lab.objects.all() if labs is None else labs)
    for (project, zone), zone_labs in sorted(_pairs(labs).items(), key=lambda kv: kv[0]):
        try:
            nodes = cloud_tpu().list_nodes(project, zone)
        except CloudError as exc:
            report.errors[f"{project}/{zone}"] = str(exc)
            log.warning("listing %s/%s failed: %s", project, zone, exc)
            sync_health.record_failure(zone_labs, zone, str(exc))
            continue
        report.listed += len(nodes)
        for lab in zone_labs:
            _sync_zone(lab, zone, {n.name: n for n in nodes}, report)
        sync_health.record_success(zone_labs, zone)
    checked = published_keys.vms_to_check(report.listed_vms, report.keys_due)
    report.host_key_changes = published_keys.check_vms(checked)
    return report


def _sync_zone(lab: Lab, zone: str, nodes: dict[str, NodeInfo], report: SyncReport) -> None:
    """Write only what changed: an unchanged VM costs no query beyond the shared
    ``last_seen_at`` update, so a poll stays cheap as the lab grows."""
    now = timezone.now()
    vms = TpuVm.objects.filter(lab=lab, zone=zone, source__in=API_SOURCES)
    seen = []
    for vm in vms.prefetch_related("workers"):
        node = nodes.get(vm.name)
        if node is None:
            _mark_missing(lab, vm, now, report)
            continue
        seen.append(vm.pk)
        if node.state == NodeState.READY and made_anew.pins_predate(vm, node.create_time):
            # New machines behind the name: re-pinned from what they publish before
            # anything connects to them (and before their keys are compared below).
            if made_anew.recognise(vm, node):
                vm.refresh_from_db()
        elif made_anew.may_have_late_workers(vm, node, now):
            # Workers that published no keys when their node was pinned (a node made
            # anew whose guest agents had not written them yet) are pinned once they do.
            if made_anew.pin_late_workers(vm, node):
                vm.refresh_from_db()
        before = (vm.state, vm.health)
        recreated = _recreated(vm, node)
        changed = apply_node(vm, node)
        came_back = vm.missing_since is not None
        if recreated or came_back:
            # Maybe new hosts behind the same name: compare their published host keys.
            report.keys_due.add(vm.pk)
        if not changed and not came_back and not _workers_differ(vm, node):
            continue
        with transaction.atomic():
            vm.missing_since = None
            vm.save()
            moved = _sync_workers(vm, node)
            report.ip_changes += len(moved)
            if moved:
                ipchanges.announce(vm, moved)
                report.keys_due.add(vm.pk)
            if changed:
                report.updated += 1
            healthy = (NodeState.READY, NodeHealth.HEALTHY)
            if (before != healthy and (vm.state, vm.health) == healthy) or moved:
                # Back from maintenance or a reboot: mounts and accounts are checked again.
                ipchanges.hosts_must_be_checked(
                    vm, "external address changed" if moved else "ready and healthy again"
                )
            if vm.state != before[0] and vm.state in job_engine.GONE_STATES:
                _pass_for_lost_jobs(vm)
            if before != (vm.state, vm.health) or came_back:
                audit.record(
                    AuditAction.VM_STATE_CHANGED,
                    lab=lab,
                    summary=f"{vm.name}: {before[0]}/{before[1]} → {vm.state}/{vm.health}",
                    data={"vm": vm.pk, "from": list(before), "to": [vm.state, vm.health]},
                )
    TpuVm.objects.filter(pk__in=seen).update(last_seen_at=now)
    report.listed_vms.update(seen)


def _pass_for_lost_jobs(vm: TpuVm) -> None:
    """A VM whose job's processes went with it (preempted, repairing, deleted): its
    pass ends the job now, not at the next job poll, so a job run again elsewhere
    (``scheduler``) starts on another VM of its kind one sync after the loss."""
    if Job.objects.filter(vm=vm, state__in=ACTIVE_STATES).exists():
        queue.advance_jobs(vm.pk)


def _recreated(vm: TpuVm, node: NodeInfo) -> bool:
    """Whether the node was created again since the portal last saw it (a create_time
    differing by a second or more; the API's nanoseconds are not stored)."""
    if vm.node_created_at is None or node.create_time is None:
        return False
    return abs((node.create_time - vm.node_created_at).total_seconds()) >= 1


def _mark_missing(lab: Lab, vm: TpuVm, now, report: SyncReport) -> None:
    if vm.missing_since is not None:
        return
    with transaction.atomic():
        if TpuVm.objects.filter(pk=vm.pk, missing_since=None).update(missing_since=now):
            report.missing += 1
            _pass_for_lost_jobs(vm)
            audit.record(
                AuditAction.VM_MISSING,
                lab=lab,
                summary=f"{vm.name} is no longer listed by the Cloud TPU API",
                data={"vm": vm.pk},
            )


def _workers_differ(vm: TpuVm, node: NodeInfo) -> bool:
    """Whether any worker's addresses (or the set of workers) differ from the API's."""
    known = {w.index: (w.internal_ip, w.external_ip) for w in vm.workers.all()}
    for info in node.workers:
        if info.index not in known:
            return True
        internal, external = known[info.index]
        if (info.internal_ip and info.internal_ip != internal) or (
            info.external_ip and info.external_ip != external
        ):
            return True
    return False


def _sync_workers(vm: TpuVm, node: NodeInfo) -> list[IpChange]:
    """Follow the workers' addresses. A new non-empty external IP is a change, recorded
    only by the sync whose conditional update wins, so two syncs at once record it
    once. No IP (maintenance) is not a change: the last known address stays."""
    existing = {w.index: w for w in vm.workers.all()}
    changes = []
    for info in node.workers:
        worker = existing.get(info.index)
        if worker is None:
            # A worker the portal has not seen: it has no pinned key until an admin
            # confirms one, so nothing is sent to it.
            Worker.objects.create(
                vm=vm, index=info.index, internal_ip=info.internal_ip or None,
                external_ip=info.external_ip or None,
            )  # fmt: skip
            continue
        if info.internal_ip and info.internal_ip != worker.internal_ip:
            Worker.objects.filter(pk=worker.pk).update(internal_ip=info.internal_ip)
        new = info.external_ip
        if not new or new == worker.external_ip:
            continue
        won = Worker.objects.filter(pk=worker.pk, external_ip=worker.external_ip).update(
            external_ip=new
        )
        if won:
            changes.append(
                IpChange.objects.create(worker=worker, old_ip=worker.external_ip, new_ip=new)
            )
    return changes

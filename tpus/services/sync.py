"""Keeping the inventory current: one ListNodes per (project, zone) across every lab,
then each registered VM is updated from what was listed.

A zone whose listing failed is left exactly as it was: a transient API error never
marks a VM missing or changes an address.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import transaction
from django.utils import timezone

from tpus import audit
from tpus.cloud import CloudError, NodeInfo
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction, Lab
from tpus.models.inventory import TpuVm, VmSource
from tpus.services.inventory import apply_node, apply_workers

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    listed: int = 0
    updated: int = 0
    missing: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # "project/zone" -> message


def _pairs(labs) -> dict[tuple[str, str], list[Lab]]:
    pairs: dict[tuple[str, str], list[Lab]] = defaultdict(list)
    for lab in labs:
        for zone in lab.zones:
            pairs[(lab.gcp_project_id, zone)].append(lab)
    return pairs


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
            continue
        report.listed += len(nodes)
        for lab in zone_labs:
            _sync_zone(lab, zone, {n.name: n for n in nodes}, report)
    return report


def _sync_zone(lab: Lab, zone: str, nodes: dict[str, NodeInfo], report: SyncReport) -> None:
    now = timezone.now()
    vms = TpuVm.objects.filter(lab=lab, zone=zone, source=VmSource.IMPORTED)
    for vm in vms.prefetch_related("workers"):
        node = nodes.get(vm.name)
        with transaction.atomic():
            if node is None:
                if vm.missing_since is None:
                    TpuVm.objects.filter(pk=vm.pk).update(missing_since=now)
                    report.missing += 1
                    audit.record(
                        AuditAction.VM_MISSING,
                        lab=lab,
                        summary=f"{vm.name} is no longer listed by the Cloud TPU API",
                        data={"vm": vm.pk},
                    )
                continue
            before = (vm.state, vm.health)
            changed = apply_node(vm, node)
            vm.last_seen_at = now
            came_back = vm.missing_since is not None
            vm.missing_since = None
            vm.save()
            apply_workers(vm, node)
            if changed:
                report.updated += 1
            if before != (vm.state, vm.health) or came_back:
                audit.record(
                    AuditAction.VM_STATE_CHANGED,
                    lab=lab,
                    summary=f"{vm.name}: {before[0]}/{before[1]} → {vm.state}/{vm.health}",
                    data={"vm": vm.pk, "from": list(before), "to": [vm.state, vm.health]},
                )

"""Comparing the host keys the Cloud TPU API publishes (guest attributes ``hostkeys/``)
with the keys the portal pinned.

A worker's keys are pinned once (at import, or by an admin). The API keeps publishing
what the guest agent wrote, which changes when the VM is re-created. The sync reads
them again when there is a reason to — a new address, a new boot seen by a reconcile,
the node's create_time changed, the node listed again after it was missing — and, in
a slow pass, for ``PORTAL_HOST_KEY_CHECKS_PER_SYNC`` more VMs per sync, the least
recently compared first. One GetGuestAttributes per VM, whatever its worker count.

A published change (``Worker.published_key_changes``) is treated like a presented one:
the worker's host key alarm goes up (the reconcile no longer contacts it) and the
lab's admins are told, once. Nothing is ever pinned from here: a published key is
only a claim that any process on the VM could have written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from django.conf import settings
from django.db.models import F, Min
from django.utils import timezone

from tpus.cloud import CloudError, host_key_line
from tpus.cloud.config import cloud_tpu
from tpus.models import TpuVm, Worker
from tpus.models.inventory import API_SOURCES
from tpus.services.hostkey_alarms import raise_alarm

log = logging.getLogger(__name__)


def vms_to_check(candidates: Iterable[int], due: Iterable[int]) -> list[int]:
    """Which of the ``candidates`` (VMs the sync just listed) to compare now: those
    ``due`` for a reason, those a reconcile asked about, and the slow pass's share."""
    pinned = Worker.objects.exclude(host_keys=[]).values("vm_id")
    eligible = TpuVm.objects.filter(
        pk__in=list(candidates), source__in=API_SOURCES, missing_since=None
    ).filter(pk__in=pinned)
    asked = Worker.objects.filter(published_keys_recheck=True).values("vm_id")
    wanted = set(eligible.filter(pk__in=list(due)).values_list("pk", flat=True))
    wanted |= set(eligible.filter(pk__in=asked).values_list("pk", flat=True))
    share = settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC
    if share:
        oldest = (
            eligible.exclude(pk__in=wanted)
            .annotate(checked=Min("workers__published_keys_checked_at"))
            .order_by(F("checked").asc(nulls_first=True), "pk")
            .values_list("pk", flat=True)
            .distinct()
        )
        wanted |= set(oldest[:share])
    return sorted(wanted)


def check_vm(vm: TpuVm) -> list[Worker]:
    """Read what the API publishes for the VM's pinned workers (one call) and compare
    it with their pins. Returns the workers whose published keys changed since the
    last comparison and contradict the pins; their alarm is raised. A failed call
    changes nothing: the VM stays due and is tried at a later sync."""
    workers = [w for w in vm.workers.select_related("vm__lab") if w.is_pinned]
    if not workers:
        return []
    try:
        published = cloud_tpu().guest_host_keys(
            vm.lab.gcp_project_id, vm.zone, vm.name, workers=[w.index for w in workers]
        )
    except CloudError as exc:
        log.warning("host keys published for %s unavailable: %s", vm, exc)
        return []
    now = timezone.now()
    changed = []
    for worker in workers:
        lines = sorted(
            line
            for key_type, value in published.for_worker(worker.index).items()
            if (line := host_key_line(key_type, value))
        )
        # Only a new published set can raise the alarm: one an admin has already
        # seen (and resumed the worker despite) is not news.
        is_news = lines != sorted(worker.published_host_keys)
        Worker.objects.filter(pk=worker.pk).update(
            published_host_keys=lines, published_keys_checked_at=now, published_keys_recheck=False
        )
        worker.published_host_keys = lines
        contradicting = worker.published_key_changes()
        if is_news and contradicting:
            log.warning("%s: the API publishes a host key that is not pinned", worker.alias)
            raise_alarm(worker, _shown(contradicting), published=True)
            changed.append(worker)
    return changed


def check_vms(vm_ids: Iterable[int]) -> list[Worker]:
    """``check_vm`` for each VM; the workers whose published keys changed."""
    changed = []
    for vm in TpuVm.objects.filter(pk__in=list(vm_ids)).select_related("lab").order_by("pk"):
        changed += check_vm(vm)
    return changed


def _shown(lines: list[str]) -> str:
    """The one contradicting key kept beside the alarm: ed25519 when it is among them
    (what ssh prefers), else the first; the worker's page lists them all."""
    return next((line for line in lines if line.startswith("ssh-ed25519 ")), lines[0])

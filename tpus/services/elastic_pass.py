"""The elastic pools' pass: does what ``elastic_pools`` decides. Grows a pool through
the one way a VM is asked for (``vm_requests.store``: a queued request, the chips
claimed with the lab's row locked), and deletes a VM it made that sat idle past its
limit through the portal's own deletion (``vm_lifecycle.delete_idle_vm``).

It runs on the beat (``PORTAL_ELASTIC_POOL_SECONDS``) for every pool; a pool job
submitted that no VM took grows its kind's pool in the submit's own transaction
(``grow_kind``), so the request is sent with the job's commit. Nothing in it waits on
Google: a request's call and its follow-up are the request's own tasks.
"""

from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Lab, TpuVm, VmRequest
from tpus.models.elastic import ElasticPool
from tpus.models.provisioning import chips_of
from tpus.services import allowances, elastic_pools, vm_lifecycle, vm_requests
from tpus.services.vm_requests import VmSpec

log = logging.getLogger(__name__)


def run_all() -> None:
    """Every pool with something to do: the ones switched on grow; any pool's idle
    VMs go (a pool switched off still lets go of what it made)."""
    for pool_id in ElasticPool.objects.order_by("pk").values_list("pk", flat=True):
        check(pool_id)


def check(pool_id: int) -> None:
    pool = ElasticPool.objects.select_related("lab").filter(pk=pool_id).first()
    if pool is None:
        return
    if pool.enabled:
        grow(pool.pk)
    shrink(pool.pk)


def check_kind(lab_id: int, accelerator_type: str) -> None:
    """The pool of a kind, if the lab has one switched on."""
    pool = ElasticPool.objects.filter(
        lab_id=lab_id, accelerator_type=accelerator_type, enabled=True
    ).first()
    if pool is not None:
        check(pool.pk)


def grow_kind(
    lab_id: int, accelerator_type: str, *, lab: Lab | None = None, granted: set[int] | None = None
) -> list[int]:
    """Grow the kind's pool, if the lab has one switched on (``grow``): what a submit
    that no free VM took does before it commits. With ``lab``, the caller locked the
    lab's row in this transaction (the submit): the pool's row is locked and read in
    one query, and the lab is not read again; ``granted``, the people with a kind
    grant in force on the type as the caller read them. Returns the requests made."""
    if lab is not None:
        pool = (
            ElasticPool.objects.select_for_update()
            .filter(lab_id=lab.pk, accelerator_type=accelerator_type, enabled=True)
            .first()
        )
        return [] if pool is None else _grow(pool, lab, granted)
    pool_id = (
        ElasticPool.objects.filter(lab_id=lab_id, accelerator_type=accelerator_type, enabled=True)
        .values_list("pk", flat=True)
        .first()
    )
    return [] if pool_id is None else grow(pool_id)


def no_vm_took(
    sender,
    *,
    lab_id: int,
    accelerator_type: str,
    lab: Lab | None = None,
    granted: set[int] | None = None,
    **kwargs,
) -> None:
    """``jobs.no_vm_took``: a pool job's submit that no free VM took grows its kind's
    pool in the submit's transaction (the lab's row locked by the submit)."""
    grow_kind(lab_id, accelerator_type, lab=lab, granted=granted)


def grow(pool_id: int) -> list[int]:
    """Ask for the VMs the pool's waiting jobs need, with the lab's row locked while
    it counts and asks: a pass at the same moment waits, then counts what this one
    asked for. Each request claims its chips (``allowances.claim``); one refused stops
    it, and why is kept on the pool. Returns the requests made."""
    with transaction.atomic():
        lab = Lab.objects.select_for_update().get(
            pk=ElasticPool.objects.values_list("lab_id", flat=True).get(pk=pool_id)
        )
        pool = ElasticPool.objects.select_for_update().get(pk=pool_id)
        return _grow(pool, lab)


def _grow(pool: ElasticPool, lab: Lab, granted: set[int] | None = None) -> list[int]:
    """``grow`` with the lab's row and then the pool's locked in this transaction. The
    chips each request claims are counted from the scene read under that lock, with
    the requests made since (``allowances.Standing``): nothing else may claim chips of
    the lab until this transaction ends."""
    pool.lab = lab
    if not pool.enabled:
        return []
    made = []
    scene = elastic_pools.read(pool, granted=granted)
    needed = elastic_pools.need(scene)
    refused = needed.refused
    if not needed.zones and needed.uncovered == 0 and scene.waiting_at_google:
        refused = "capacity at Google: queued, waiting for resources"
    _, chips = chips_of(pool.accelerator_type)
    for zone in needed.zones:
        name = _next_name(pool, zone)
        spec = VmSpec(
            name=name,
            zone=zone,
            accelerator_type=pool.accelerator_type,
            runtime_version=pool.runtime_version,
            provisioning=pool.provisioning,
            queued=True,
        )
        standing = allowances.Standing(
            lab, scene.allowance_chips, scene.used_chips + len(made) * chips
        )
        try:
            # The request's own transaction (a savepoint) is undone alone when refused.
            request = vm_requests.store(
                lab,
                spec,
                elastic_pool=pool,
                elastic_reason=elastic_pools.reason(scene, asked=len(made)),
                standing=standing,
            )
        except ValidationError as exc:
            refused = exc.messages[0]
            break
        except IntegrityError:  # a VM or request of that name: take the next number
            log.warning("%s: %s is taken", pool, name)
            continue
        made.append(request.pk)
    ElasticPool.objects.filter(pk=pool.pk).update(
        next_number=pool.next_number, refused=refused, checked_at=timezone.now()
    )
    return made


def _next_name(pool: ElasticPool, zone: str) -> str:
    """The pool's next VM name no VM or request of the lab has in the zone (a VM keeps
    its row, and its name, once deleted; an admin may have used one)."""
    while True:
        name = f"{pool.accelerator_type}-pool-{pool.next_number}"
        pool.next_number += 1
        taken = TpuVm.objects.filter(lab=pool.lab, zone=zone, name=name).exists()
        if not taken and not VmRequest.objects.filter(lab=pool.lab, zone=zone, name=name).exists():
            return name


def shrink(pool_id: int) -> list[int]:
    """Delete each VM the pool made that has run no job for its idle limit, unless a
    waiting job it could take is counted. Returns the VMs whose deletion was sent."""
    pool = ElasticPool.objects.select_related("lab").get(pk=pool_id)
    now = timezone.now()
    due = [vm for vm in elastic_pools.idle_vms(pool) if vm.due(pool, now)]
    if not due:
        return []
    scene = elastic_pools.read(pool)
    gone = []
    for vm in due:
        if pool.enabled and elastic_pools.wanted_by_waiting(scene, vm):
            continue
        idle_for = int((now - vm.idle_since).total_seconds() // 60)
        why = (
            f"deleted by the {pool.accelerator_type} elastic pool after {idle_for} min "
            f"idle (limit {pool.idle_minutes} min)"
        )
        if vm_lifecycle.delete_idle_vm(TpuVm.objects.get(pk=vm.vm_id), why):
            audit.record(
                AuditAction.ELASTIC_POOL_SHRANK,
                lab=pool.lab,
                summary=f"{vm.name}: {why}",
                data={
                    "elastic_pool": pool.pk,
                    "vm": vm.vm_id,
                    "idle_since": vm.idle_since.isoformat(),
                },
            )
            gone.append(vm.vm_id)
    return gone

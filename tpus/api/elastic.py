"""API endpoints for a lab's elastic pools (lab admins): per accelerator type, switch
the pool on or off and read what it made, what it asked for and why, and why it does
not grow."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from ninja import Router, Schema, Status

from portal.schemas import Error
from tpus import access
from tpus.api.jobs import JobError
from tpus.api.pool import _refused
from tpus.models.elastic import DEFAULT_IDLE_MINUTES
from tpus.services import elastic_admin

router = Router(tags=["provisioning"])


class PoolVmOut(Schema):
    id: int
    name: str
    zone: str
    state: str
    idle_since: datetime | None
    idle_minutes: int | None


class PoolRequestOut(Schema):
    id: int
    name: str
    zone: str
    state: str
    reason: str
    created_at: datetime


class ElasticPoolOut(Schema):
    """One kind's elastic pool: off unless a lab admin switched it on. ``refused`` says
    why its last pass did not ask for a VM that waiting jobs need (the allowance is
    full, the lab's grant ended, its maximum, or capacity at Google: queued)."""

    accelerator_type: str
    enabled: bool
    provisioning: str | None = None
    zones: list[str] = []
    runtime_version: str | None = None
    idle_minutes: int = DEFAULT_IDLE_MINUTES
    max_vms: int | None = None
    refused: str = ""
    checked_at: datetime | None = None
    vms: list[PoolVmOut] = []
    requests: list[PoolRequestOut] = []


class ElasticPoolIn(Schema):
    enabled: bool
    provisioning: str = "spot"
    zones: list[str] = []
    runtime_version: str = ""
    idle_minutes: int = DEFAULT_IDLE_MINUTES
    max_vms: int | None = None


def _out(view: elastic_admin.PoolView) -> dict:
    pool = view.pool
    out = {"accelerator_type": view.accelerator_type, "enabled": view.enabled}
    if pool is not None:
        out |= {
            "provisioning": pool.provisioning,
            "zones": pool.zones,
            "runtime_version": pool.runtime_version,
            "idle_minutes": pool.idle_minutes,
            "max_vms": pool.max_vms,
            "refused": pool.refused if pool.enabled else "",
            "checked_at": pool.checked_at,
        }
    return out | {"vms": view.vms, "requests": view.requests}


@router.get(
    "/labs/{slug}/elastic-pools",
    response=list[ElasticPoolOut],
    summary="The lab's elastic pools, one per kind it has (lab admins)",
)
def list_elastic_pools(request, slug: str):
    lab = access.get_admin_lab(request.user, slug)
    return [_out(view) for view in elastic_admin.views(lab)]


@router.put(
    "/labs/{slug}/elastic-pools/{accelerator_type}",
    response={200: ElasticPoolOut, 400: JobError, 403: Error},
    summary="Switch a kind's elastic pool on (with what its VMs are made with) or off",
    description="On: the portal asks Google for a VM of the kind (a queued request, "
    "spot or preemptible, within the lab's allowance) when jobs of people with access "
    "to every VM of the kind wait and none can take them, and deletes a VM it made "
    "once it has run no job for `idle_minutes`.",
)
def set_elastic_pool(request, slug: str, accelerator_type: str, payload: ElasticPoolIn):
    lab = access.get_admin_lab(request.user, slug)
    try:
        pool = elastic_admin.set_pool(
            request.user, lab, accelerator_type, **payload.dict(), request=request
        )
    except ValidationError as exc:
        return _refused(exc)
    view = next(v for v in elastic_admin.views(lab) if v.accelerator_type == pool.accelerator_type)
    return Status(200, _out(view))

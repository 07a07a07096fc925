"""What a lab admin sets and sees of the lab's elastic pools: switching one on for an
accelerator type (spot or preemptible, zones, runtime version, idle limit, maximum),
audited; and per kind, the VMs its pool made, its open requests with why they were
asked, and why it refuses to grow (``views``). What a pool does is decided by
``elastic_pools`` and done by ``elastic_pass``."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from portal import audit
from tpus import access
from tpus.cloud import CloudError
from tpus.cloud.config import cloud_tpu
from tpus.models import AuditAction, Lab, VmRequest
from tpus.models.elastic import DEFAULT_IDLE_MINUTES, ElasticPool
from tpus.models.provisioning import OPEN_REQUEST_STATES, Provisioning
from tpus.services import kind_grants
from tpus.services.elastic_pools import POOL_KINDS, idle_vms, pool_vms
from tpus.services.grants import GrantError

# --- settings --------------------------------------------------------------------------


def set_pool(
    admin,
    lab: Lab,
    accelerator_type: str,
    *,
    enabled: bool,
    provisioning: str = Provisioning.SPOT,
    zones: list[str] | None = None,
    runtime_version: str = "",
    idle_minutes: int = DEFAULT_IDLE_MINUTES,
    max_vms: int | None = None,
    request=None,
) -> ElasticPool:
    """Switch the lab's elastic pool of ``accelerator_type`` on (with what its VMs are
    asked for with) or off. Lab admins only. A bad field is a ValidationError naming
    it, with nothing stored; switching on asks the Cloud TPU API whether each zone
    offers the type and the runtime version, as a request would. Switched off, the
    pool asks for nothing more; the VMs it made still go once idle."""
    if not access.is_lab_admin(admin, lab):
        raise PermissionDenied("Only the lab's admins can change an elastic pool.")
    accelerator_type = (accelerator_type or "").strip()
    zones = list(dict.fromkeys(str(z).strip() for z in (zones or [])))
    runtime_version = (runtime_version or "").strip()
    errors: dict[str, list[str]] = {}

    def add(name: str, text: str) -> None:
        errors.setdefault(name, []).append(text)

    try:
        kind_grants.check_kind(lab, accelerator_type)
    except GrantError as exc:  # a type the lab neither has nor may make
        add("accelerator_type", str(exc))
    if enabled:
        if provisioning not in POOL_KINDS:
            add("provisioning", "An elastic pool asks for spot or preemptible VMs.")
        if not zones:
            add("zones", f"Choose one or more of the lab's zones: {', '.join(lab.zones)}.")
        for zone in zones:
            if zone not in lab.zones:
                add("zones", f"{zone[:60]} is not one of the lab's zones ({', '.join(lab.zones)}).")
        if not runtime_version:
            add("runtime_version", "Name the runtime version its VMs are made with.")
        if not lab.gcp_project_id:
            add("zones", "The lab has no GCP project yet; a site admin sets it.")
    if not isinstance(idle_minutes, int) or not 1 <= idle_minutes <= 10_080:
        add("idle_minutes", "An idle limit is 1 to 10080 minutes (a week).")
    if max_vms is not None and (not isinstance(max_vms, int) or not 1 <= max_vms <= 1000):
        add("max_vms", "A maximum is 1 to 1000 VMs, or none.")
    if enabled and not errors:
        _check_offered(lab, accelerator_type, zones, runtime_version, add)
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        pool, _ = ElasticPool.objects.select_for_update().get_or_create(
            lab=lab, accelerator_type=accelerator_type, defaults={"runtime_version": ""}
        )
        pool.enabled = enabled
        if enabled:
            pool.provisioning, pool.zones, pool.runtime_version = (
                provisioning,
                zones,
                runtime_version,
            )
        pool.idle_minutes, pool.max_vms = idle_minutes, max_vms
        pool.changed_at, pool.changed_by = timezone.now(), admin
        if not enabled:
            pool.refused = ""
        pool.save()
        audit.record(
            AuditAction.ELASTIC_POOL_SET,
            actor=admin,
            lab=lab,
            summary=settings_text(pool),
            data={
                "elastic_pool": pool.pk,
                "accelerator_type": accelerator_type,
                "enabled": enabled,
                "provisioning": pool.provisioning,
                "zones": pool.zones,
                "runtime_version": pool.runtime_version,
                "idle_minutes": idle_minutes,
                "max_vms": max_vms,
            },
            request=request,
        )
    return pool


def _check_offered(lab: Lab, accelerator_type: str, zones, version: str, add) -> None:
    client = cloud_tpu()
    for zone in zones:
        try:
            types = client.accelerator_types(lab.gcp_project_id, zone)
            versions = client.runtime_versions(lab.gcp_project_id, zone)
        except CloudError as exc:
            add("zones", f"The Cloud TPU API could not say what {zone} offers: {exc}")
            continue
        if accelerator_type not in types:
            add("zones", f"{zone} offers no {accelerator_type}.")
        if version not in versions:
            add("runtime_version", f"{zone} has no runtime version {version}.")


def settings_text(pool: ElasticPool) -> str:
    if not pool.enabled:
        return f"{pool.accelerator_type} elastic pool off"
    text = (
        f"{pool.accelerator_type} elastic pool on: {pool.get_provisioning_display().lower()} "
        f"in {', '.join(pool.zones)}, {pool.runtime_version}, deleted after "
        f"{pool.idle_minutes} min idle"
    )
    if pool.max_vms:
        text += f", at most {pool.max_vms} VMs"
    return text


# --- what the kinds page shows -------------------------------------------------------------


@dataclass
class PoolView:
    """One kind's elastic pool as the kinds page and the API show it."""

    accelerator_type: str
    pool: ElasticPool | None
    vms: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.pool and self.pool.enabled)


def views(lab: Lab) -> list[PoolView]:
    """Per kind of the lab: its pool's settings, the VMs it made (state, idle since),
    its open requests with why they were asked, and why it refuses to grow."""
    pools = {p.accelerator_type: p for p in ElasticPool.objects.filter(lab=lab)}
    kinds = sorted(set(kind_grants.lab_kinds(lab)) | set(pools))
    out = []
    now = timezone.now()
    for kind in kinds:
        view = PoolView(kind, pools.get(kind))
        if view.pool is not None:
            idle = {vm.vm_id: vm for vm in idle_vms(view.pool)}
            for vm in pool_vms(view.pool).order_by("name"):
                since = idle.get(vm.pk)
                view.vms.append(
                    {
                        "id": vm.pk,
                        "name": vm.name,
                        "zone": vm.zone,
                        "state": vm.state,
                        "idle_since": since.idle_since if since else None,
                        "idle_minutes": int((now - since.idle_since).total_seconds() // 60)
                        if since
                        else None,
                    }
                )
            for made in VmRequest.objects.filter(
                elastic_pool=view.pool, state__in=OPEN_REQUEST_STATES
            ).order_by("created_at", "pk"):
                view.requests.append(
                    {
                        "id": made.pk,
                        "name": made.name,
                        "zone": made.zone,
                        "state": made.state,
                        "state_text": made.get_state_display(),
                        "reason": made.elastic_reason,
                        "created_at": made.created_at,
                    }
                )
        out.append(view)
    return out

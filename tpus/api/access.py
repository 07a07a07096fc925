"""API endpoints about access: grants (lab admins), the caller's own TPU VMs, their
ssh config and known_hosts, and a VM's IP history."""

from __future__ import annotations

from datetime import date, datetime

from django.db.models import (
    Count,
    IntegerField,
    OuterRef,
    Prefetch,
    Subquery,
    prefetch_related_objects,
)
from django.db.models.functions import Coalesce
from django.http import HttpResponse
from ninja import Query, Router, Schema, Status
from ninja.pagination import paginate
from pydantic import BaseModel, model_validator

from portal.pagination import KeysetPagination, parse_choice, parse_since
from portal.schemas import Error
from tpus import access
from tpus.api import filters as api_filters
from tpus.api.docs import PAGED, filter_help
from tpus.models import Grant, IpChange, TpuVm, Worker
from tpus.models.grants import WANTED_STATES, GrantState
from tpus.models.inventory import worker_alias
from tpus.services import grants as grant_services
from tpus.services import sshconfig
from tpus.services.grants import GrantError

router = Router(tags=["access"])


class GrantWorkerOut(BaseModel):
    """Where one worker of the grant's VM stands with this grant."""

    index: int
    alias: str
    # applied: the worker has this grant's change; waiting: not yet tried;
    # retrying: the worker could not be reached, the portal tries again;
    # failed: the worker refused (for this person, or for good); see ``error``.
    state: str
    error: str
    last_attempt_at: datetime | None


class GrantOut(BaseModel):
    """A grant. A plain pydantic model filled from the grant by ``fields_of`` in one
    pass (lists carry up to 100 of them), not a field at a time through resolvers."""

    id: int
    vm: str
    vm_id: int
    # The slug of the VM's lab: the VM's paths are under /labs/{lab}/vms/{vm_id}.
    lab: str
    user: str
    username: str | None
    sudo: bool
    expires_on: date | None
    state: str
    error: str
    activated_at: datetime | None
    # Set while a failure the hosts may get over is waiting for its next try.
    retry_at: datetime | None
    # How many of the VM's workers have this grant's change, and the others (those
    # holding it up, with their state and error); empty once every worker has it.
    workers_total: int
    workers_applied: int
    workers: list[GrantWorkerOut]
    # The accelerator type of the kind grant that gave it; null for a grant by hand.
    from_kind: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_grant(cls, obj):
        return cls.fields_of(obj) if isinstance(obj, Grant) else obj

    @staticmethod
    def fields_of(grant: Grant) -> dict:
        standing = grant_workers(grant)
        total = workers_total(grant)
        error = grant.error
        if not error and grant.state == GrantState.PENDING:
            # A grant still pending says what holds it up, as the VM page does.
            stuck = [w for w in standing if w["error"]]
            error = "; ".join(f"{w['alias']} ({w['state']}): {w['error']}" for w in stuck)
        account = getattr(grant.user, "unix_account", None)
        return {
            "id": grant.pk,
            "vm": grant.vm.name,
            "vm_id": grant.vm_id,
            "lab": grant.vm.lab.slug,
            "user": grant.user.email,
            "username": account.username if account else None,
            "sudo": grant.sudo,
            "expires_on": grant.expires_on,
            "state": grant.state,
            "error": error,
            "activated_at": grant.activated_at,
            "retry_at": grant.retry_at,
            "workers_total": total,
            "workers_applied": (
                total if grant.state in _SETTLED else sum(w["state"] == "applied" for w in standing)
            ),
            "workers": [w for w in standing if w["state"] != "applied"],
            "from_kind": grant.from_kind.accelerator_type if grant.from_kind_id else None,
        }


class VmWorkerOut(BaseModel):
    """A worker of a VM you have access to: its name in your ssh config (``alias``) and
    its addresses, the internal one on the pod's own network."""

    index: int
    alias: str
    internal_ip: str | None
    external_ip: str | None


class MyGrantOut(GrantOut):
    """A grant of yours with what you need of its VM: its zone, its accelerator type
    (the kind a job for the lab's pool names), its state as the Cloud TPU API reports
    it (READY, PREEMPTED, STOPPED …) and its workers with their addresses (none once
    the grant is revoked or being revoked)."""

    zone: str
    accelerator_type: str
    vm_state: str
    vm_workers: list[VmWorkerOut]

    @staticmethod
    def fields_of(grant: Grant) -> dict:
        wanted = grant.state in WANTED_STATES
        return {
            **GrantOut.fields_of(grant),
            "zone": grant.vm.zone,
            "accelerator_type": grant.vm.accelerator_type,
            "vm_state": grant.vm.state,
            "vm_workers": getattr(grant, "vm_addresses", []) if wanted else [],
        }


def with_addresses(grants: list[Grant]) -> list[Grant]:
    """A page of the person's grants, with the workers of their VMs and their addresses
    (``vm_addresses``) read in one query of plain rows."""
    rows: dict[int, list[dict]] = {}
    workers = Worker.objects.filter(vm__in={grant.vm_id for grant in grants})
    for row in workers.order_by("vm_id", "index").values(
        "vm_id", "index", "internal_ip", "external_ip"
    ):
        rows.setdefault(row["vm_id"], []).append(row)
    for grant in grants:
        grant.vm_addresses = [
            {
                "index": row["index"],
                "alias": worker_alias(grant.vm.name, row["index"]),
                "internal_ip": row["internal_ip"],
                "external_ip": row["external_ip"],
            }
            for row in rows.get(grant.vm_id, [])
        ]
    return grants


# Every worker confirmed a settled grant when it settled; what a worker does later is
# the VM's news (its workers' last reconcile), not this grant's.
_SETTLED = (GrantState.ACTIVE, GrantState.REVOKED)
IN_FLIGHT = [state for state in GrantState.values if state not in _SETTLED]


def grant_workers(grant) -> list[dict]:
    """The standing with ``grant`` of each worker that does not have it yet, from what
    it last answered (none for a settled grant). Uses the VM's workers as prefetched
    by the lists (``with_standing``, ``_WITH_WORKERS``), else loads them once; worked
    out once per grant object."""
    if grant.state in _SETTLED:
        return []
    cached = getattr(grant, "_worker_standing", None)
    if cached is None:
        cached = grant._worker_standing = _standing_from_syncs(grant)
    return cached


def workers_total(grant) -> int:
    """How many workers the grant's VM has: counted by the lists (``with_worker_count``)
    or from the workers already loaded."""
    counted = getattr(grant, "vm_worker_count", None)
    if counted is not None:
        return counted
    if grant.state in _SETTLED:
        return grant.vm.workers.count()
    return len(grant_workers(grant))


def _standing_from_syncs(grant) -> list[dict]:
    cache = getattr(grant.vm, "_prefetched_objects_cache", {})
    workers = cache.get("workers")
    if not workers:  # not prefetched, or the grant went in flight after the prefetch read
        workers = grant.vm.workers.select_related("sync")
    return [worker_standing(worker, grant) for worker in workers]


def worker_standing(worker, grant) -> dict:
    """Where ``worker`` (loaded with its ``sync``) stands with a grant in flight, from
    what it last answered."""
    username = getattr(getattr(grant.user, "unix_account", None), "username", "")
    sync = worker.last_sync
    refused = [
        entry.partition(":")[2]
        for entry in ((sync.last_report or {}).get("user_error", []) if sync else [])
        if entry.partition(":")[0] == username
    ]
    if refused:
        state, error = "failed", refused[0]
    elif sync and sync.applied_version >= grant.version and not sync.last_error:
        state, error = "applied", ""
    elif sync and sync.last_error:
        state = "retrying" if sync.last_error_retryable else "failed"
        error = sync.last_error
    else:
        state, error = "waiting", ""
    return {
        "index": worker.index,
        "alias": worker.alias,
        "state": state,
        "error": error,
        "last_attempt_at": sync.last_attempt_at if sync else None,
    }


# The VM's workers and what each last did, in one query for a whole page of grants;
# only of VMs with a grant in flight (a settled grant needs just the count).
_WITH_WORKERS = Prefetch(
    "vm__workers",
    queryset=Worker.objects.filter(
        vm__in=TpuVm.objects.filter(grants__state__in=IN_FLIGHT).values("pk")
    ).select_related("sync", "vm"),
)


def with_worker_count(grants):
    """``grants`` with ``vm_worker_count``: their VM's workers, counted per row."""
    counted = Worker.objects.filter(vm=OuterRef("vm")).order_by().values("vm")
    counted = counted.annotate(n=Count("pk")).values("n")
    return grants.annotate(
        vm_worker_count=Coalesce(Subquery(counted, output_field=IntegerField()), 0)
    )


class GrantIn(Schema):
    user_email: str
    vm_ids: list[int]
    sudo: bool = False
    expires_on: date | None = None


class IpChangeOut(Schema):
    worker: str
    old_ip: str | None
    new_ip: str
    seen_at: datetime

    @staticmethod
    def resolve_worker(obj):
        return obj.worker.alias


def with_standing(grants: list[Grant]) -> list[Grant]:
    """A page of grants, with the workers (and what each last did) of the VMs of the
    grants in flight on it, in one query; none when every grant there is settled
    (``with_worker_count`` counts their workers)."""
    in_flight = [grant.vm for grant in grants if grant.state not in _SETTLED]
    workers = Worker.objects.select_related("sync")
    prefetch_related_objects(in_flight, Prefetch("workers", queryset=workers))
    return grants


# What ``GrantOut.fields_of`` reads of a grant, its VM and its person.
_GRANT_COLUMNS = (
    "vm__name",
    "vm__lab__slug",
    "user__email",
    "user__unix_account__username",
    "sudo",
    "expires_on",
    "state",
    "version",
    "error",
    "activated_at",
    "retry_at",
    "from_kind__accelerator_type",
)


@router.get(
    "/labs/{slug}/grants",
    response=list[GrantOut],
    summary="A lab's grants (lab admins)",
    description=PAGED,
)
@paginate(KeysetPagination, prepare=with_standing)
def list_grants(
    request,
    slug: str,
    state: str | None = Query(None, description=filter_help("state", GrantState)),
    user: str | None = Query(None, description=filter_help("user")),
    vm: str | None = Query(None, description=filter_help("vm")),
    zone: str | None = Query(None, description=filter_help("zone")),
    updated_since: str | None = Query(None, description=filter_help("updated_since")),
):
    lab = access.get_admin_lab(request.user, slug)
    grants = with_worker_count(
        Grant.objects.filter(vm__lab=lab)
        .select_related("vm__lab", "user__unix_account", "from_kind")
        .only(*_GRANT_COLUMNS)
    )
    return _filter_grants(
        grants,
        state=parse_choice(state, GrantState, "state"),
        user=api_filters.lab_member(lab, user),
        vm=api_filters.lab_vm(lab, vm),
        zone=api_filters.lab_zone(lab, zone),
        since=parse_since(updated_since),
    )


def _filter_grants(grants, *, state=None, user=None, vm=None, zone=None, since=None):
    if state:
        grants = grants.filter(state=state)
    if user is not None:
        grants = grants.filter(user=user)
    if vm is not None:
        grants = grants.filter(vm=vm)
    if zone:
        grants = grants.filter(vm__zone=zone)
    if since is not None:
        grants = grants.filter(changed_at__gte=since)
    return grants


@router.post(
    "/labs/{slug}/grants",
    response={201: list[GrantOut], 400: Error},
    summary="Give a member access to TPU VMs (lab admins)",
)
def create_grants(request, slug: str, payload: GrantIn):
    lab = access.get_admin_lab(request.user, slug)
    membership = (
        lab.memberships.select_related("user")
        .filter(user__email__iexact=payload.user_email.strip())
        .first()
    )
    if membership is None or len(payload.vm_ids) > 100:
        return Status(400, {"detail": f"{payload.user_email} is not a member of {lab.name}."})
    vms = [access.get_vm_for_admin(request.user, lab, vm_id) for vm_id in payload.vm_ids]
    try:
        grants = grant_services.grant_access(
            request.user,
            lab,
            membership.user,
            vms,
            sudo=payload.sudo,
            expires_on=payload.expires_on,
            request=request,
        )
    except GrantError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, grants)


@router.post("/labs/{slug}/grants/{grant_id}/revoke", response=GrantOut, summary="Revoke a grant")
def revoke_grant(request, slug: str, grant_id: int):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    return grant_services.revoke_access(request.user, grant, request=request)


@router.post(
    "/labs/{slug}/grants/{grant_id}/retry",
    response={200: GrantOut, 409: Error},
    summary="Try a failed grant again (lab admins)",
)
def retry_grant(request, slug: str, grant_id: int):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    if grant.state != GrantState.FAILED:
        return Status(409, {"detail": f"The grant is {grant.state}; only a failed one is retried."})
    return Status(200, grant_services.retry_grant(request.user, grant, request=request))


@router.get(
    "/me/grants",
    response=list[MyGrantOut],
    summary="My access to TPU VMs, with each VM's lab, state and workers' addresses",
    description=PAGED,
)
@paginate(KeysetPagination, prepare=with_addresses)
def my_grants(
    request,
    state: str | None = Query(None, description=filter_help("state", GrantState)),
    updated_since: str | None = Query(None, description=filter_help("updated_since")),
):
    grants = with_worker_count(
        request.user.grants.select_related(
            "vm__lab", "user__unix_account", "from_kind"
        ).prefetch_related(_WITH_WORKERS)
    )
    return _filter_grants(
        grants, state=parse_choice(state, GrantState, "state"), since=parse_since(updated_since)
    )


@router.get("/me/ssh-config", summary="My ssh config (text)")
def my_ssh_config(request):
    return HttpResponse(sshconfig.render_config(request.user), content_type="text/plain")


@router.get("/me/known-hosts", summary="The pinned host keys for my ssh config (text)")
def my_known_hosts(request):
    body = sshconfig.render_known_hosts(sshconfig.vms_for(request.user))
    return HttpResponse(body, content_type="text/plain")


class SshForwardOut(BaseModel):
    local: int
    remote: int


class SshWorkerOut(BaseModel):
    index: int
    address: str | None
    alias: str
    host_keys: list[str]


class SshVmOut(BaseModel):
    lab: str
    name: str
    zone: str
    host: str
    forward_agent: bool
    forwards: list[SshForwardOut]
    workers: list[SshWorkerOut]


class SshHostsOut(BaseModel):
    """What the ssh config and known_hosts are made of (``username`` is null until it
    is chosen, and then there are no VMs)."""

    username: str | None
    vms: list[SshVmOut]


@router.get(
    "/me/ssh-hosts",
    response=SshHostsOut,
    summary="My ssh hosts as data: names, addresses, host key aliases and keys, forwards",
)
def my_ssh_hosts(request):
    return sshconfig.hosts_for(request.user)


@router.get(
    "/labs/{slug}/vms/{vm_id}/ip-history",
    response=list[IpChangeOut],
    summary="External IP changes of a VM's workers",
    description=PAGED + " This list has no `total`: it grows for as long as the VM lives.",
)
@paginate(KeysetPagination, with_total=False)
def ip_history(
    request,
    slug: str,
    vm_id: int,
    updated_since: str | None = Query(
        None, description="Only changes seen at or after this ISO 8601 time."
    ),
):
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    changes = IpChange.objects.filter(worker__vm=vm).select_related("worker__vm")
    since = parse_since(updated_since)
    return changes.filter(seen_at__gte=since) if since is not None else changes

"""API endpoints about one VM's workers (lab admins): how provisioning goes on each,
and reviewing and pinning a worker's host keys. They are what the VM page's
"Provisioning on each worker" and a worker's host keys page show, found through
``tpus.access`` and changed through the same services."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

from ninja import Router, Schema, Status

from accounts.sshkeys import fingerprint_sha256
from portal.schemas import Error
from tpus import access
from tpus.api.access import worker_standing
from tpus.models.grants import GrantState
from tpus.services import hostkey_scans, leases
from tpus.services.inventory import InventoryError

router = Router(tags=["workers"])

# Grants on their way to the hosts: the ones a worker may still have to apply.
_MOVING = (GrantState.PENDING, GrantState.REVOKING)


class HostKeyOut(Schema):
    """One host key: its ``type base64`` line and the fingerprint ssh prints for it."""

    type: str
    key: str
    fingerprint: str


def _key(line: str) -> dict:
    key_type, _, blob = line.partition(" ")
    try:
        fingerprint = fingerprint_sha256(base64.b64decode(blob, validate=True))
    except (binascii.Error, ValueError):
        fingerprint = ""
    return {"type": key_type, "key": line, "fingerprint": fingerprint}


def _keys(lines: list[str]) -> list[dict]:
    return [_key(line) for line in lines]


def host_key_state(worker) -> str:
    """``alarm``: provisioning stopped because the worker presented another key;
    ``published_alarm``: the Cloud TPU API publishes another key, for an admin to
    review, while the worker (which presents its pinned key) is still provisioned;
    ``unpinned``: no keys confirmed yet, so the portal does not connect; ``pinned``:
    the portal connects with its pinned keys."""
    if worker.host_key_mismatch_at is not None:
        return "published_alarm" if worker.host_key_alarm_published else "alarm"
    return "pinned" if worker.is_pinned else "unpinned"


class PendingGrantOut(Schema):
    """A grant in flight that this worker has not applied yet."""

    grant_id: int
    user: str
    username: str | None
    # pending (being given) or revoking.
    grant_state: str
    # waiting, retrying (the worker could not be reached) or failed (it refused).
    state: str
    error: str


class WorkerProgressOut(Schema):
    index: int
    alias: str
    internal_ip: str | None
    external_ip: str | None
    # up_to_date, retrying, failed, host_keys_unconfirmed, stalled, working or queued:
    # the badge the VM page shows for the worker.
    state: str
    applied_version: int | None
    desired_version: int
    last_attempt_at: datetime | None
    last_success_at: datetime | None
    last_error: str
    last_error_retryable: bool
    # pinned, unpinned or alarm (see ``host_key_alarm_since`` and the worker's keys).
    host_keys: str
    host_key_alarm_since: datetime | None
    pending_grants: list[PendingGrantOut]


class VmProgressOut(Schema):
    vm_id: int
    name: str
    desired_version: int
    # A reconcile holds the VM now; or since when the one that held it stopped
    # renewing its claim (it is picked up again shortly).
    running: bool
    stalled_since: datetime | None
    # Whether any grant is on its way: poll while it is.
    in_flight: bool
    workers: list[WorkerProgressOut]


def _worker_state(worker, sync, desired: int, running: bool, stalled) -> str:
    """The VM page's badge for the worker, in the same order of precedence."""
    if sync is not None and sync.applied_version >= desired:
        return "up_to_date"
    if sync is not None and sync.last_error:
        return "retrying" if sync.last_error_retryable else "failed"
    if not worker.is_pinned:
        return "host_keys_unconfirmed"
    if stalled is not None:
        return "stalled"
    return "working" if running else "queued"


def _progress(vm) -> dict:
    workers = list(vm.workers.select_related("sync", "vm").order_by("index"))
    moving = list(
        vm.grants.filter(state__in=_MOVING).select_related("user__unix_account").order_by("pk")
    )
    running, stalled = leases.held_or_stalled(vm.reconcile_claimed_until)
    rows = []
    for worker in workers:
        sync = worker.last_sync
        pending = []
        for grant in moving:
            standing = worker_standing(worker, grant)
            if standing["state"] == "applied":
                continue
            account = getattr(grant.user, "unix_account", None)
            pending.append(
                {
                    "grant_id": grant.pk,
                    "user": grant.user.email,
                    "username": account.username if account else None,
                    "grant_state": grant.state,
                    "state": standing["state"],
                    "error": standing["error"],
                }
            )
        rows.append(
            {
                "index": worker.index,
                "alias": worker.alias,
                "internal_ip": worker.internal_ip,
                "external_ip": worker.external_ip,
                "state": _worker_state(worker, sync, vm.desired_version, running, stalled),
                "applied_version": sync.applied_version if sync else None,
                "desired_version": vm.desired_version,
                "last_attempt_at": sync.last_attempt_at if sync else None,
                "last_success_at": sync.last_success_at if sync else None,
                "last_error": sync.last_error if sync else "",
                "last_error_retryable": bool(sync and sync.last_error_retryable),
                "host_keys": host_key_state(worker),
                "host_key_alarm_since": worker.host_key_mismatch_at,
                "pending_grants": pending,
            }
        )
    return {
        "vm_id": vm.pk,
        "name": vm.name,
        "desired_version": vm.desired_version,
        "running": running,
        "stalled_since": stalled,
        "in_flight": bool(moving),
        "workers": rows,
    }


@router.get(
    "/labs/{slug}/vms/{vm_id}/progress",
    response=VmProgressOut,
    summary="How provisioning goes on each worker of a VM (lab admins)",
)
def vm_progress(request, slug: str, vm_id: int):
    lab = access.get_admin_lab(request.user, slug)
    return _progress(access.get_vm_for_admin(request.user, lab, vm_id))


class ScanOut(Schema):
    # queued, scanning, done or failed.
    state: str
    address: str
    requested_at: datetime
    finished_at: datetime | None
    error: str
    # What the address offered (once done).
    keys: list[HostKeyOut]
    same_as_pinned: bool
    # Pass this back to ``…/host-keys/pin`` to pin exactly these keys; null unless
    # the scan is done. It names the worker and address and expires after 15 minutes.
    shown: str | None


class WorkerKeysOut(Schema):
    index: int
    alias: str
    external_ip: str | None
    # pinned, unpinned or alarm.
    state: str
    pinned: list[HostKeyOut]
    # guest_attributes (pinned at import) or admin (confirmed by an admin).
    pinned_source: str
    pinned_at: datetime | None
    # What the Cloud TPU API publishes for the worker, when it was last compared, and
    # whether it says the keys changed.
    published: list[HostKeyOut]
    published_checked_at: datetime | None
    published_differs: bool
    # While provisioning of the worker is stopped: since when, and the key it
    # presented (or that was published) instead of the pinned ones.
    alarm_since: datetime | None
    presented: HostKeyOut | None
    # The last scan of the worker's current address; null before any (or once the
    # worker has moved to another address).
    scan: ScanOut | None


def _worker_keys(worker) -> dict:
    scan = hostkey_scans.current_scan(worker)
    scanned = hostkey_scans.scanned_keys(scan)
    return {
        "index": worker.index,
        "alias": worker.alias,
        "external_ip": worker.external_ip,
        "state": host_key_state(worker),
        "pinned": _keys(worker.host_keys),
        "pinned_source": worker.host_keys_source,
        "pinned_at": worker.host_keys_pinned_at,
        "published": _keys(worker.published_host_keys),
        "published_checked_at": worker.published_keys_checked_at,
        "published_differs": bool(worker.published_key_changes()),
        "alarm_since": worker.host_key_mismatch_at,
        "presented": _key(worker.presented_host_key) if worker.presented_host_key else None,
        "scan": None
        if scan is None
        else {
            "state": scan.state,
            "address": scan.address,
            "requested_at": scan.requested_at,
            "finished_at": scan.finished_at,
            "error": scan.error,
            "keys": _keys(scanned),
            "same_as_pinned": bool(scanned) and sorted(scanned) == sorted(worker.host_keys),
            "shown": hostkey_scans.shown_token(worker, scan.address, scanned) if scanned else None,
        },
    }


def _worker(request, slug: str, vm_id: int, index: int):
    lab = access.get_admin_lab(request.user, slug)
    return access.get_worker_for_admin(request.user, lab, vm_id, index)


@router.get(
    "/labs/{slug}/vms/{vm_id}/workers/{index}/host-keys",
    response=WorkerKeysOut,
    summary="A worker's pinned, published and scanned host keys (lab admins)",
)
def worker_keys(request, slug: str, vm_id: int, index: int):
    return _worker_keys(_worker(request, slug, vm_id, index))


@router.post(
    "/labs/{slug}/vms/{vm_id}/workers/{index}/host-keys/scan",
    response={202: WorkerKeysOut, 400: Error},
    summary="Read the host keys the worker's address offers (queued; poll the keys)",
)
def scan_worker_keys(request, slug: str, vm_id: int, index: int):
    worker = _worker(request, slug, vm_id, index)
    try:
        hostkey_scans.start_scan(request.user, worker)
    except InventoryError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(202, _worker_keys(worker))


class PinIn(Schema):
    # The ``shown`` of a finished scan, as ``GET …/host-keys`` returned it.
    shown: str


@router.post(
    "/labs/{slug}/vms/{vm_id}/workers/{index}/host-keys/pin",
    response={200: WorkerKeysOut, 400: Error},
    summary="Pin exactly the scanned keys that were shown (replaces pinned ones)",
)
def pin_worker_keys(request, slug: str, vm_id: int, index: int, payload: PinIn):
    worker = _worker(request, slug, vm_id, index)
    try:
        worker = hostkey_scans.pin_shown_keys(request.user, worker, payload.shown, request=request)
    except InventoryError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(200, _worker_keys(worker))

"""Reading a worker's host keys for an admin to confirm, as queued work.

The admin starts a scan; a task reads the keys the worker's address offers (through
``tpus.remote``, never inside the request) and stores them on the worker's
``HostKeyScan``; the page polls until they are there and then shows the fingerprints
with the confirmation form. What the admin was shown travels back signed
(``shown_token``), bound to the worker and the address the keys were read from, and
``pin_shown_keys`` pins exactly those keys (``inventory.pin_host_keys`` /
``repin_host_keys``); the page and the API both confirm this way.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.utils import timezone

from tpus import queue
from tpus.models import HostKeyScan, Worker
from tpus.models.inventory import ScanState
from tpus.remote import RemoteError, scan_host_keys
from tpus.remote.pins import HostKeyPins, InvalidHostKey
from tpus.services import inventory
from tpus.services.inventory import InventoryError

SALT = "tpu-portal.host-keys-shown"
# How long an admin may look at the fingerprints before confirming them.
SHOWN_MAX_AGE = 900


def start_scan(admin, worker: Worker) -> HostKeyScan:
    """Queue a reading of the keys ``worker`` offers at its current external address;
    any earlier result of this worker is replaced. The caller has checked that
    ``admin`` administers the worker's lab."""
    if not worker.external_ip:
        raise InventoryError("The worker has no external IP right now; nothing to scan.")
    with transaction.atomic():
        scan, _ = HostKeyScan.objects.update_or_create(
            worker=worker,
            defaults={
                "state": ScanState.QUEUED,
                "address": worker.external_ip,
                "keys": [],
                "error": "",
                "requested_by": admin,
                "requested_at": timezone.now(),
                "finished_at": None,
            },
        )
        queue.scan_host_keys(scan.pk)
    return scan


def run_scan(scan_id: int) -> None:
    """Read the keys for a queued scan. Claimed with a conditional update, so a task
    delivered twice scans once; a scan restarted meanwhile (its row reset to queued)
    is run by its own task."""
    claimed = HostKeyScan.objects.filter(pk=scan_id, state=ScanState.QUEUED).update(
        state=ScanState.SCANNING
    )
    if not claimed:
        return
    scan = HostKeyScan.objects.get(pk=scan_id)
    try:
        keys, error, state = scan_host_keys(scan.address), "", ScanState.DONE
    except RemoteError as exc:
        keys, error, state = [], str(exc), ScanState.FAILED
    # Written only if no newer scan replaced this one while the keys were read.
    HostKeyScan.objects.filter(
        pk=scan_id, state=ScanState.SCANNING, requested_at=scan.requested_at
    ).update(state=state, keys=keys, error=error, finished_at=timezone.now())


def current_scan(worker: Worker) -> HostKeyScan | None:
    """The worker's scan if it is about the address the worker has now; a scan of an
    address the worker has left says nothing about it."""
    scan = HostKeyScan.objects.filter(worker=worker).first()
    if scan is None or scan.address != worker.external_ip:
        return None
    return scan


def stalled_scans() -> list[int]:
    """Scans whose task was lost (still queued a minute on) or whose run died (still
    scanning long after any connection would have timed out): reset to queued, so the
    sweep queues them again and a late answer of the dead run is not taken."""
    now = timezone.now()
    lost = now - dt.timedelta(seconds=60)
    dead = now - dt.timedelta(
        seconds=2 * (settings.PORTAL_REMOTE_CONNECT_TIMEOUT + settings.PORTAL_REMOTE_AUTH_TIMEOUT)
        + 60
    )
    ids = list(
        HostKeyScan.objects.filter(state=ScanState.QUEUED, requested_at__lt=lost).values_list(
            "pk", flat=True
        )
    )
    for scan in HostKeyScan.objects.filter(state=ScanState.SCANNING, requested_at__lt=dead):
        # A new requested_at: whatever the dead run writes later matches no row.
        if HostKeyScan.objects.filter(
            pk=scan.pk, state=ScanState.SCANNING, requested_at=scan.requested_at
        ).update(state=ScanState.QUEUED, requested_at=now):
            ids.append(scan.pk)
    return ids


def scanned_keys(scan: HostKeyScan | None) -> list[str]:
    """The keys a finished scan read; nothing while it runs or when it failed."""
    return scan.keys if scan is not None and scan.state == ScanState.DONE else []


def shown_token(worker: Worker, address: str, keys: list[str]) -> str:
    """What a confirmation carries back: the keys, and the worker and address they
    were read from, signed so none of it can be swapped."""
    return signing.dumps({"worker": worker.pk, "address": address, "keys": keys}, salt=SALT)


def shown_keys(worker: Worker, shown: str) -> list[str]:
    """The keys an admin confirmed for this worker at its current address. Raises
    ``InventoryError`` when they were not the ones shown, are too old, or were read
    from another worker or address."""
    try:
        payload = signing.loads(shown, salt=SALT, max_age=SHOWN_MAX_AGE)
        worker_id, address, lines = payload["worker"], payload["address"], payload["keys"]
        HostKeyPins.parse(lines)
    except (signing.BadSignature, InvalidHostKey, TypeError, KeyError):
        raise InventoryError("Those keys were not the ones shown; scan again.") from None
    if worker_id != worker.pk:
        raise InventoryError(
            f"Those keys were read from another worker, not {worker.alias}; scan again."
        )
    if address != worker.external_ip:
        raise InventoryError(
            f"Those keys were read from {address}, but {worker.alias} is now at "
            f"{worker.external_ip or 'no address'}; scan again."
        )
    return lines


def pin_shown_keys(admin, worker: Worker, shown: str, *, request=None) -> Worker:
    """Pin exactly the keys in ``shown`` (see ``shown_token``): a first pin for a
    worker without keys, a deliberate replacement for one that has them. The caller
    has checked that ``admin`` administers the worker's lab."""
    lines = shown_keys(worker, shown)
    if worker.is_pinned:
        return inventory.repin_host_keys(admin, worker, lines, request=request)
    return inventory.pin_host_keys(admin, worker, lines, request=request)

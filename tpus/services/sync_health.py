"""How each lab's inventory sync is going, per zone: recorded by every sync (periodic
or "Refresh now"), shown on the lab's pages and in the API, and told to the lab's
admins once when listing a zone has failed for longer than
``PORTAL_SYNC_ALERT_SECONDS``, and once when it works again.

Both emails are claimed with a conditional UPDATE of the zone's row, so two syncs at
once (two beats, a refresh during a periodic run) send each one exactly once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from django.conf import settings
from django.db import transaction
from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone

from portal import audit
from tpus.models import AuditAction, Lab, ZoneSync
from tpus.services import emails


def _row(lab: Lab, zone: str) -> ZoneSync:
    row, _ = ZoneSync.objects.get_or_create(lab=lab, zone=zone)
    return row


def record_success(labs: Iterable[Lab], zone: str) -> None:
    """The zone was listed. An outage the admins were told about ends with one email."""
    now = timezone.now()
    for lab in labs:
        row = _row(lab, zone)
        with transaction.atomic():
            recovered = ZoneSync.objects.filter(pk=row.pk, alerted_at__isnull=False).update(
                alerted_at=None, failing_since=None, last_error="", last_success_at=now
            )
            if recovered:
                audit.record(
                    AuditAction.SYNC_RECOVERED,
                    lab=lab,
                    summary=f"{zone}: listing TPU VMs works again",
                    data={"zone": zone, "failing_since": _iso(row.failing_since)},
                )
                since = row.failing_since.isoformat() if row.failing_since else ""
                emails.send_sync_alert(row.pk, "recovered", since)
                continue
        ZoneSync.objects.filter(pk=row.pk).update(
            failing_since=None, last_error="", last_success_at=now
        )


def record_failure(labs: Iterable[Lab], zone: str, error: str) -> None:
    """Listing the zone failed with ``error`` (a CloudError's message). Once it has
    been failing for ``PORTAL_SYNC_ALERT_SECONDS``, the lab's admins are told, once."""
    now = timezone.now()
    threshold = now - dt.timedelta(seconds=settings.PORTAL_SYNC_ALERT_SECONDS)
    for lab in labs:
        row = _row(lab, zone)
        ZoneSync.objects.filter(pk=row.pk, failing_since__isnull=True).update(failing_since=now)
        ZoneSync.objects.filter(pk=row.pk).update(last_failure_at=now, last_error=error[:2000])
        with transaction.atomic():
            alerted = ZoneSync.objects.filter(
                pk=row.pk, alerted_at__isnull=True, failing_since__lte=threshold
            ).update(alerted_at=now)
            if alerted:
                row.refresh_from_db()
                audit.record(
                    AuditAction.SYNC_FAILING,
                    lab=lab,
                    summary=f"{zone}: {error}"[:300],
                    data={"zone": zone, "failing_since": _iso(row.failing_since), "error": error},
                )
                emails.send_sync_alert(row.pk, "failing", "")


def _iso(value) -> str | None:
    return value.isoformat() if value else None


def for_lab(lab: Lab) -> list[ZoneSync]:
    """One row per zone of the lab (unsaved and blank for a zone never synced), in the
    lab's zone order, then any zone the lab no longer lists but its VMs are in."""
    rows = {row.zone: row for row in ZoneSync.objects.filter(lab=lab)}
    shown = [rows.pop(zone, None) or ZoneSync(lab=lab, zone=zone) for zone in lab.zones]
    return shown + sorted(rows.values(), key=lambda r: r.zone)


def for_vm(vm) -> ZoneSync:
    """The sync status of the VM's zone (blank and unsaved if never synced)."""
    return ZoneSync.objects.filter(lab_id=vm.lab_id, zone=vm.zone).first() or ZoneSync(
        lab_id=vm.lab_id, zone=vm.zone
    )


def by_lab(lab_ids: Iterable[int]) -> dict[int, list[ZoneSync]]:
    """The recorded rows of several labs, in one query."""
    found: dict[int, list[ZoneSync]] = {}
    for row in ZoneSync.objects.filter(lab_id__in=list(lab_ids)):
        found.setdefault(row.lab_id, []).append(row)
    return found


SYNC_FIELDS = ("last_success_at", "last_failure_at", "failing_since", "last_error")


def with_zone_sync(vms: QuerySet) -> QuerySet:
    """Annotate each VM with its zone's sync status (``sync_<field>``), in the same
    query, so a list of VMs costs no query per VM."""
    rows = ZoneSync.objects.filter(lab_id=OuterRef("lab_id"), zone=OuterRef("zone"))
    return vms.annotate(**{f"sync_{name}": Subquery(rows.values(name)[:1]) for name in SYNC_FIELDS})

"""Which TPU VMs the periodic sweep should reconcile."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db.models import F, Min, Q
from django.utils import timezone

from tpus.models import Grant, TpuVm
from tpus.models.grants import GrantState


def vms_to_reconcile() -> list[int]:
    """VMs with grants still in flight, workers behind the desired version, or no full
    reconcile for a while (drift check)."""
    in_flight = Grant.objects.filter(
        state__in=(GrantState.PENDING, GrantState.REVOKING)
    ).values_list("vm_id", flat=True)
    stale_before = timezone.now() - dt.timedelta(seconds=settings.PORTAL_DRIFT_CHECK_SECONDS)
    behind = (
        TpuVm.objects.filter(grants__isnull=False, missing_since=None)
        .annotate(
            oldest=Min("workers__sync__applied_version"),
            last_ok=Min("workers__sync__last_success_at"),
        )
        .filter(
            Q(oldest__isnull=True)
            | Q(oldest__lt=F("desired_version"))
            | Q(last_ok__lt=stale_before)
        )
        .values_list("pk", flat=True)
    )
    return sorted(set(in_flight) | set(behind))

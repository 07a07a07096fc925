"""Who holds a VM's chips outside the portal: when the portal looks.

The look itself is ``job_engine.check_usage`` (one ``job-status.sh`` exec per worker,
stored on the VM as ``outside_holders`` and ``usage_checked_at``); a running job's
poll and a job's pre-flight record the same list on their way. Reading usage never
looks: the usage page and ``/api/v1/labs/{slug}/usage`` show the last answer with its
time. The portal looks

- on a schedule (``look_at_idle_vms``, every PORTAL_HOLDER_PASS_SECONDS): at most
  PORTAL_HOLDER_PASS_VMS VMs a run, those looked at least recently first, only VMs no
  job holds (their poll looks already) whose last look is older than
  PORTAL_HOLDER_MAX_AGE_SECONDS;
- for a VM whose page someone has open (``look_when_stale``): at most once per
  PORTAL_JOB_USAGE_REFRESH_SECONDS per VM, however many people have it open.
"""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.core.cache import cache
from django.db.models import DateTimeField, Exists, OuterRef, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from tpus import queue
from tpus.models import Job, TpuVm, Worker
from tpus.models.jobs import ACTIVE_STATES
from tpus.services.job_engine import GONE_STATES

# States in which a VM's workers cannot be asked (as the job pass judges them).
UNREADY_STATES = [*GONE_STATES, TpuVm.State.CREATING, TpuVm.State.STARTING]
# Before any look: sorts first.
_NEVER = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def is_stale(vm: TpuVm) -> bool:
    """The VM's last look is older than PORTAL_JOB_USAGE_REFRESH_SECONDS (or none)."""
    age = dt.timedelta(seconds=settings.PORTAL_JOB_USAGE_REFRESH_SECONDS)
    return vm.usage_checked_at is None or timezone.now() - vm.usage_checked_at > age


def claim_look(vm_id: int) -> bool:
    """At most one queued look at a VM's chips per PORTAL_JOB_USAGE_REFRESH_SECONDS,
    whoever asks (an atomic add in the shared cache)."""
    return cache.add(
        f"tpu-portal:usage-look:{vm_id}",
        True,
        timeout=max(1, settings.PORTAL_JOB_USAGE_REFRESH_SECONDS),
    )


def look_when_stale(now) -> list[int]:
    """For the VM pages someone has open: queue a look at each VM of ``now``
    (``usage.VmNow`` rows) that no job holds and whose last look is stale. The page
    does not wait for it; no query. Returns the VMs' ids."""
    stale = [n.vm.pk for n in now if n.running is None and is_stale(n.vm)]
    stale = [vm_id for vm_id in stale if claim_look(vm_id)]
    for vm_id in stale:
        queue.check_tpu_usage(vm_id)
    return stale


def last_look():
    """The later of the VM's last answered look and the pass's last ask."""
    never = Value(_NEVER, DateTimeField())
    return Greatest(
        Coalesce("usage_checked_at", never),
        Coalesce("holders_looked_at", never),
    )


def look_at_idle_vms(limit: int | None = None, *, now: dt.datetime | None = None) -> list[int]:
    """The scheduled pass: queue a look at up to ``limit`` (PORTAL_HOLDER_PASS_VMS) VMs
    that are up (not stopped, gone or being created), that no job holds, and whose
    last look is older than PORTAL_HOLDER_MAX_AGE_SECONDS, least recently looked at
    first. Each chosen VM is
    stamped ``holders_looked_at`` first, so one whose workers do not answer goes to
    the back of the line instead of taking a place in every run. One query to choose,
    one to stamp; returns the VMs' ids."""
    limit = settings.PORTAL_HOLDER_PASS_VMS if limit is None else limit
    now = now or timezone.now()
    if limit <= 0:
        return []
    oldest = now - dt.timedelta(seconds=settings.PORTAL_HOLDER_MAX_AGE_SECONDS)
    held = Job.objects.filter(vm=OuterRef("pk"), state__in=ACTIVE_STATES)
    chosen = list(
        TpuVm.objects.filter(missing_since__isnull=True)
        .exclude(state__in=UNREADY_STATES)
        .alias(
            last=last_look(),
            held=Exists(held),
            has_workers=Exists(Worker.objects.filter(vm=OuterRef("pk"))),
        )
        .filter(last__lt=oldest, held=False, has_workers=True)
        .order_by("last", "pk")
        .values_list("pk", flat=True)[:limit]
    )
    if not chosen:
        return []
    TpuVm.objects.filter(pk__in=chosen).update(holders_looked_at=now)
    looked = [vm_id for vm_id in chosen if claim_look(vm_id)]
    for vm_id in looked:
        queue.check_tpu_usage(vm_id)
    return looked

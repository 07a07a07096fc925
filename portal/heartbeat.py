"""Is the background machinery running? Beat schedules a heartbeat, a worker runs it,
and the site admin's dashboard reads when that last happened.

Beat's first heartbeat comes one interval after it starts (later if the worker is
still starting), so a stack that has just started has none yet, and that is normal:
until the first is due, plus a grace, the answer is *starting*, not *not running*.
What "just started" means: beat records when it started (``beat_started``, from its
``beat_init`` signal); a web process that finds no heartbeat and no start of beat
counts from its own start (the three usually start together)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from django.core.cache import cache
from django.utils import timezone

KEY = "portal:heartbeat"
BEAT_STARTED_KEY = "portal:beat-started"
# After the first heartbeat is due: the worker may be busy or still starting.
GRACE_SECONDS = 30
# When this process started (what a web process counts from while beat said nothing).
PROCESS_STARTED = time.time()


def beat() -> None:
    cache.set(KEY, timezone.now().timestamp(), timeout=None)


def record_beat_started() -> None:
    """Beat has started: its first heartbeat is due one interval from now."""
    cache.set(BEAT_STARTED_KEY, timezone.now().timestamp(), timeout=None)


def _when(key: str) -> dt.datetime | None:
    stamp = cache.get(key)
    return None if stamp is None else dt.datetime.fromtimestamp(stamp, tz=dt.UTC)


def last_seen() -> dt.datetime | None:
    return _when(KEY)


def is_alive(interval: float) -> bool:
    seen = last_seen()
    return seen is not None and timezone.now() - seen < dt.timedelta(seconds=3 * interval)


@dataclass(frozen=True)
class Status:
    """``state``: ``running`` (a heartbeat within three intervals), ``starting`` (none
    since beat or this process started, and the first is not overdue yet: ``due_by``)
    or ``stopped``; ``seen``: the last heartbeat, if any."""

    state: str
    seen: dt.datetime | None
    due_by: dt.datetime | None = None


def status(interval: float) -> Status:
    seen = last_seen()
    if is_alive(interval):
        return Status("running", seen)
    now = timezone.now()
    started = _when(BEAT_STARTED_KEY)
    if started is None or (seen is not None and started <= seen):
        # Beat has not said it started since the last heartbeat; with no heartbeat
        # at all, this process's own start stands in for the stack's.
        started = None if seen is not None else dt.datetime.fromtimestamp(PROCESS_STARTED, dt.UTC)
    if started is not None:
        due_by = started + dt.timedelta(seconds=interval + GRACE_SECONDS)
        if now < due_by:
            return Status("starting", seen, due_by)
    return Status("stopped", seen)

"""Is the background machinery running? Beat schedules a heartbeat, a worker runs it,
and the site admin's dashboard reads when that last happened."""

from __future__ import annotations

import datetime as dt

from django.core.cache import cache
from django.utils import timezone

KEY = "portal:heartbeat"


def beat() -> None:
    cache.set(KEY, timezone.now().timestamp(), timeout=None)


def last_seen() -> dt.datetime | None:
    stamp = cache.get(KEY)
    return None if stamp is None else dt.datetime.fromtimestamp(stamp, tz=dt.UTC)


def is_alive(interval: float) -> bool:
    seen = last_seen()
    return seen is not None and timezone.now() - seen < dt.timedelta(seconds=3 * interval)

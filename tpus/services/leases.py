"""Short leases that running work renews, so a holder that dies (killed worker, lost
database) is noticed within one lease, however long the work itself may take.

A lease is a ``claimed_until`` style column, taken with a conditional UPDATE by the
code that owns the row. ``Heartbeat`` renews it from a thread while the work runs;
``PORTAL_RECONCILE_CLAIM_SECONDS`` is the length, renewed every third of it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import QuerySet
from django.utils import timezone

log = logging.getLogger(__name__)


def length() -> dt.timedelta:
    return dt.timedelta(seconds=settings.PORTAL_RECONCILE_CLAIM_SECONDS)


class Heartbeat:
    """``with Heartbeat(Model.objects.filter(pk=...), "claimed_until"):`` keeps the
    rows' lease in the future while the block runs (only while it is still set: a
    released or finished row is left alone)."""

    def __init__(self, rows: QuerySet, field: str, what: str = ""):
        self.rows = rows
        self.field = field
        self.what = what or f"{rows.model.__name__} lease"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="lease", daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=1)

    def _beat(self) -> None:
        interval = max(0.2, length().total_seconds() / 3)
        try:
            while not self.stop.wait(interval):
                try:
                    self.rows.filter(**{f"{self.field}__isnull": False}).update(
                        **{self.field: timezone.now() + length()}
                    )
                except DatabaseError as exc:  # the next beat, or the lease, covers it
                    log.warning("cannot renew the %s: %s", self.what, exc)
        finally:
            connection.close()  # this thread's own connection


def held_or_stalled(claimed_until: dt.datetime | None) -> tuple[bool, dt.datetime | None]:
    """Whether work holds a lease now, and since when a lease has lapsed without being
    released (the holder died and stopped renewing it); ``(False, None)`` when free."""
    if claimed_until is None:
        return False, None
    if claimed_until < timezone.now():
        return False, claimed_until
    return True, None

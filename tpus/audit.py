"""Reading a lab's audit log a page at a time (writing to it is ``portal.audit``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q

from tpus.models import AuditEvent, Lab


@dataclass
class EventPage:
    """Audit events newest first, and the ids to continue from in each direction
    (None where there is nothing more)."""

    events: list[AuditEvent]
    older: int | None
    newer: int | None


def _cursor(value) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def lab_events(lab: Lab, *, older=None, newer=None, size: int = 50) -> EventPage:
    """One page of ``lab``'s events: the newest, those just older than event ``older``,
    or those just newer than event ``newer``. Keyset paging on (created_at, id): no
    COUNT(*) and no OFFSET, so page 1,000 costs what page 1 does. An unknown or
    malformed cursor gives the newest page."""
    events = AuditEvent.objects.filter(lab=lab).select_related("actor", "target_user")
    older, newer = _cursor(older), _cursor(newer)
    anchor_id = older if older is not None else newer
    anchor = (
        AuditEvent.objects.filter(lab=lab, pk=anchor_id).values("created_at", "pk").first()
        if anchor_id is not None
        else None
    )
    if anchor is None:
        rows = list(events.order_by("-created_at", "-id")[: size + 1])
        return EventPage(rows[:size], rows[size - 1].pk if len(rows) > size else None, None)
    at, pk = anchor["created_at"], anchor["pk"]
    if older is not None:
        before = Q(created_at__lt=at) | Q(created_at=at, id__lt=pk)
        rows = list(events.filter(before).order_by("-created_at", "-id")[: size + 1])
        page = rows[:size]
        return EventPage(
            page, page[-1].pk if len(rows) > size else None, page[0].pk if page else None
        )
    after = Q(created_at__gt=at) | Q(created_at=at, id__gt=pk)
    rows = list(events.filter(after).order_by("created_at", "id")[: size + 1])
    page = rows[:size][::-1]
    return EventPage(page, page[-1].pk if page else None, page[0].pk if len(rows) > size else None)

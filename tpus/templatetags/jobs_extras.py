"""Filters for the job and usage pages."""

from __future__ import annotations

import datetime as dt

from django import template

from tpus.services.usage import hours as worker_hours

register = template.Library()


@register.filter
def hours(value: dt.timedelta | None) -> str:
    """A sum of worker time as hours with two decimals: ``12.50``."""
    return f"{worker_hours(value):.2f}"


@register.filter
def elapsed(value: dt.timedelta | None) -> str:
    """A duration as people read it: ``2 h 05 min``, ``3 min 20 s``, ``12 s``."""
    if value is None:
        return ""
    seconds = max(0, int(value.total_seconds()))
    days, seconds = divmod(seconds, 86400)
    h, seconds = divmod(seconds, 3600)
    m, s = divmod(seconds, 60)
    if days:
        return f"{days} d {h} h {m:02d} min"
    if h:
        return f"{h} h {m:02d} min"
    if m:
        return f"{m} min {s:02d} s"
    return f"{s} s"

"""A generation number for "someone's readiness for access changed": a unix username
chosen, an SSH key added or deleted. Counts that depend on
those facts (how many of a lab's people can be given access) are cached under it, so
the change is seen at the next page and not after the cache entry expires."""

from __future__ import annotations

from django.core.cache import cache
from django.db import transaction

KEY = "people-generation"


def generation() -> int:
    return cache.get(KEY, 0)


def changed() -> None:
    """Call inside the change's transaction: the number moves once it commits, so a
    page reading meanwhile cannot cache the old counts under the new number."""
    transaction.on_commit(_bump)


def _bump() -> None:
    try:
        cache.incr(KEY)
    except ValueError:  # not in the cache (new, evicted or flushed): start again above 0
        if not cache.add(KEY, 1, timeout=None):
            cache.incr(KEY)

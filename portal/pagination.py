"""How every list in the API pages: ``limit`` + an opaque ``cursor``, keyset on the id.

A page is ``{"items": [...], "next": url-or-null, "total": n}``. Rows come in the order
they were created (by id); ``next`` is the absolute URL of the following page with the
same filters, null on the last page. Because the cursor remembers the last id seen
rather than a position, walking the pages visits every row that existed when the walk
began exactly once, even while rows are added (new rows have higher ids and come at
the end). ``total`` counts the rows matching the filters; it is left out of lists
whose count would cost more than the page itself (a VM's IP history).

Bad input is a 400 with ``{"detail": ...}``: a limit that is not a whole number in
range, a cursor this API did not hand out, a filter value that matches nothing the
filter could mean, or a query parameter the list does not know (a misspelt filter
must not quietly return everything).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from django.db.models import QuerySet, TextChoices
from django.http import HttpRequest
from django.utils.dateparse import parse_datetime
from django.utils.timezone import is_naive, make_aware
from ninja import Field, Schema
from ninja.conf import settings as ninja_settings
from ninja.errors import HttpError
from ninja.pagination import PaginationBase

PAGE_PARAMETERS = ("limit", "cursor")
_CURSOR_PREFIX = "k1."
_CURSOR_ID = re.compile(r"[1-9][0-9]{0,17}")  # fits a bigint


def default_limit() -> int:
    return int(ninja_settings.PAGINATION_PER_PAGE)


def max_limit() -> int:
    return int(ninja_settings.PAGINATION_MAX_LIMIT)


def _paged_description() -> str:
    return (
        "One page of the list: `{items, next, total}`. Ask for up to `limit` rows "
        f"(default {default_limit()}, at most {max_limit()}) and follow `next`, the absolute URL "
        "of the following page with the same filters, until it is null. Rows come in the "
        "order they were created; a walk sees every row that existed when it began exactly "
        "once, even while rows are added. `total` counts the rows that match the filters. "
        "A bad `limit`, `cursor` or filter value, or an unknown query parameter, is a 400 "
        "with a `detail` that says which."
    )


PAGED = _paged_description()


def parse_limit(raw: str | None, default: int | None = None) -> int:
    if raw is None or raw == "":
        return min(default or default_limit(), max_limit())
    if not raw.isdigit() or not 1 <= int(raw) <= max_limit():
        raise HttpError(400, f"limit must be a whole number from 1 to {max_limit()}, not {raw!r}.")
    return int(raw)


def encode_cursor(last_id: int) -> str:
    return base64.urlsafe_b64encode(f"{_CURSOR_PREFIX}{last_id}".encode()).decode().rstrip("=")


def decode_cursor(raw: str | None) -> int | None:
    """The last id of the previous page, or None for the first page."""
    if raw is None or raw == "":
        return None
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    value = text.removeprefix(_CURSOR_PREFIX)
    if not text.startswith(_CURSOR_PREFIX) or not _CURSOR_ID.fullmatch(value):
        raise HttpError(
            400, "cursor is not one this API handed out; start again without it and follow next."
        )
    return int(value)


def parse_since(raw: str | None, name: str = "updated_since") -> datetime | None:
    """An ISO 8601 date and time; without an offset it is read as UTC."""
    if raw is None or raw == "":
        return None
    try:
        value = parse_datetime(raw.strip())
    except ValueError:
        value = None
    if value is None:
        raise HttpError(
            400, f"{name} must be an ISO 8601 date and time such as 2025-06-01T12:00:00Z."
        )
    if is_naive(value):
        value = make_aware(value, UTC)
    return value


def parse_choice(raw: str | None, choices: type[TextChoices], name: str) -> str | None:
    if raw is None or raw == "":
        return None
    if raw not in choices.values:
        allowed = ", ".join(choices.values)
        raise HttpError(400, f"{name} must be one of {allowed}, not {raw!r}.")
    return raw


def _refuse_unknown_parameters(request: HttpRequest, known: set[str]) -> None:
    unknown = sorted(set(request.GET) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise HttpError(
            400, f"Unknown query parameter {', '.join(unknown)}; this list takes {allowed}."
        )


def _next_url(request: HttpRequest, last_id: int) -> str:
    return next_url(request, last_id)


def next_url(
    request: HttpRequest, last_id: int, *, path: str | None = None, drop: tuple[str, ...] = ()
) -> str:
    """The absolute URL of the page after the row ``last_id``: this request's query
    (less ``drop``) with a new cursor, at ``path`` (this request's own by default; a
    summary that embeds the first page of a list links to the list's own address)."""
    skip = {"cursor", *drop}
    query = [(k, v) for k, values in request.GET.lists() for v in values if k not in skip]
    query.append(("cursor", encode_cursor(last_id)))
    return request.build_absolute_uri(f"{path or request.path}?{urlencode(query)}")


def refuse_unknown_parameters(request: HttpRequest, known: set[str]) -> None:
    """A 400 that names any query parameter outside ``known`` (for hand-paged lists)."""
    _refuse_unknown_parameters(request, known)


def page_of(
    request: HttpRequest,
    queryset: QuerySet,
    *,
    limit: str | None,
    cursor: str | None,
    with_total: bool = True,
    default_limit: int | None = None,
    prepare: Callable[[list], list] | None = None,
) -> dict[str, Any]:
    """One page of ``queryset`` in id order, and the link to the next one. ``prepare``
    turns the page's rows into its items (see ``KeysetPagination``)."""
    size = parse_limit(limit, default_limit)
    after = decode_cursor(cursor)
    rows = queryset.order_by("pk")
    if after is not None:
        rows = rows.filter(pk__gt=after)
    # One row more than asked tells whether there is a next page without a count.
    items = list(rows[: size + 1])
    more = len(items) > size
    items = items[:size]
    page: dict[str, Any] = {
        "items": prepare(items) if prepare is not None else items,
        "next": _next_url(request, items[-1].pk) if more else None,
    }
    if with_total:
        page["total"] = queryset.order_by().count()
    return page


class KeysetPagination(PaginationBase):
    """django-ninja's hook for the scheme above (``@paginate(KeysetPagination)``)."""

    class Input(Schema):
        limit: str | None = Field(
            None, description="Rows per page: a whole number from 1 to the maximum."
        )
        cursor: str | None = Field(
            None, description="Where to continue: copy it from `next`, never build it."
        )

    class Output(Schema):
        items: list[Any]
        next: str | None = Field(description="The following page with the same filters.")
        total: int = Field(description="Rows matching the filters, on every page.")

    class OutputWithoutTotal(Schema):
        items: list[Any]
        next: str | None = Field(description="The following page with the same filters.")

    def __init__(
        self,
        *,
        with_total: bool = True,
        default_limit: int | None = None,
        prepare: Callable[[list], list] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.with_total = with_total
        # A list whose rows are large (a VM carries every worker of a pod) pages smaller
        # when the caller does not say.
        self.default_limit = default_limit
        # Given the page's rows (model instances, in id order), returns the items the
        # response model reads: a list loads what its rows need here, once the page is
        # known, in one query for the whole page (and none when no row needs it).
        self.prepare = prepare
        if not with_total:
            self.Output = self.OutputWithoutTotal

    def paginate_queryset(self, queryset, pagination, request, **params):
        _refuse_unknown_parameters(request, set(PAGE_PARAMETERS) | set(params))
        return page_of(
            request,
            queryset,
            limit=pagination.limit,
            cursor=pagination.cursor,
            with_total=self.with_total,
            default_limit=self.default_limit,
            prepare=self.prepare,
        )

"""Fixed-size pages for HTML lists, and links that keep the list's filters."""

from __future__ import annotations

from django.core.paginator import Page, Paginator

PAGE_SIZE = 50


def page_of(request, queryset, *, param: str = "page", size: int = PAGE_SIZE) -> Page:
    """One page of ``queryset``; a missing, bad or too large page number gives the
    first or the last page rather than an error."""
    return Paginator(queryset, size).get_page(request.GET.get(param))

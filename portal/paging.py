"""Fixed-size pages for HTML lists, and links that keep the list's filters."""

from __future__ import annotations

from django.core.paginator import Page, Paginator

PAGE_SIZE = 50


def page_of(request, queryset, *, param: str = "page", size: int = PAGE_SIZE, count=None) -> Page:
    """One page of ``queryset``; a missing, bad or too large page number gives the
    first or the last page rather than an error. ``count``, if given, is called for the
    number of rows instead of counting ``queryset`` (a count without its joins)."""
    paginator = Paginator(queryset, size)
    if count is not None:
        paginator.count = count()
    return paginator.get_page(request.GET.get(param))

"""The one place that decides between a whole page and an htmx partial."""

from django.shortcuts import render


def is_htmx(request) -> bool:
    return request.headers.get("HX-Request") == "true"


def render_page_or_partial(request, page: str, partial: str, context: dict, status=200):
    """Render ``partial`` for htmx requests and ``page`` (which includes it) otherwise."""
    return render(request, partial if is_htmx(request) else page, context, status=status)

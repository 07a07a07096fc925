"""The one place that tells an htmx request from a whole-page one."""


def is_htmx(request) -> bool:
    return request.headers.get("HX-Request") == "true"

"""The page a person sees when Django refuses a form as a possible cross-site request
(CSRF): the portal's own page, with what most likely happened and what to do."""

from __future__ import annotations

from django.shortcuts import render

# Django's reasons, by how they begin, to what a person can do about them. Anything
# else (a malformed or wrong token) is most often a page left open across a sign-in.
_ADVICE = (
    (
        "CSRF cookie not set",
        "cookie",
        "Your browser did not send the portal's cookie with the form. Allow cookies for "
        "this site, then load the page again and send the form once more.",
    ),
    (
        "Origin checking failed",
        "origin",
        "The form came from an address the portal does not answer on. Open the portal at "
        "its own address and send the form from there. If it is behind a proxy, the proxy "
        "must pass the Host header on (and SITE_URL must be the address people use).",
    ),
    (
        "Referer checking failed",
        "referer",
        "Your browser or a proxy left out where the form came from (the Referer header), "
        "which the portal needs over HTTPS. Allow it for this site, or ask whoever runs "
        "the proxy to pass it on, then send the form again.",
    ),
)
_STALE = (
    "stale",
    "The page was open for a long time, or you signed in or out in another tab since it "
    "was loaded, so the form's security token no longer matches. Nothing was changed. Go "
    "back, load the page again and send the form once more.",
)


def csrf_failure(request, reason: str = ""):
    """``CSRF_FAILURE_VIEW``: HTTP 403 with the portal's layout. Nothing was done."""
    kind, advice = _STALE
    for prefix, name, text in _ADVICE:
        if reason.startswith(prefix):
            kind, advice = name, text
            break
    return render(request, "403_csrf.html", {"advice": advice, "kind": kind}, status=403)

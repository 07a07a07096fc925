"""``/healthz``: whether this portal can do its work, for a load balancer or a monitor.

Answers without signing in and shows no secret: for each part, whether it answered
and how long it took. The web process is useless without its database and its broker
(nothing after a commit would happen), without the static files manifest (every page
would be HTTP 500) and with lab SSH keys the configured PORTAL_SECRETS_KEY cannot
decrypt (no reconcile, revoke or job of those labs could log in), so any of these
failing is HTTP 503, with the reason (never a key, a path or a lab's name). A stale
heartbeat of beat and the workers is reported as "degraded" with HTTP 200 — pages
still work, and taking the web servers out of rotation would not bring a worker
back — unless ``?strict=1`` asks for 503 on anything (for monitoring).
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from kombu import Connection

from portal import heartbeat
from portal.checks import manifest_problem
from tpus.services import labkeys

BROKER_TIMEOUT = 3.0
ESSENTIAL = ("database", "broker", "lab_keys", "static_files")


def _timed(check) -> dict:
    started = time.monotonic()
    try:
        detail = check()
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    result = {"ok": True, "ms": round((time.monotonic() - started) * 1000, 1)}
    if detail:
        result.update(detail)
    return result


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        if cursor.fetchone() != (1,):
            raise DatabaseError("SELECT 1 did not answer 1")


def _broker() -> None:
    with Connection(settings.CELERY_BROKER_URL, connect_timeout=BROKER_TIMEOUT) as conn:
        conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)


def _lab_keys() -> None:
    unreadable = labkeys.unreadable_keys()
    if unreadable:
        raise RuntimeError(
            f"the SSH private key of {unreadable} lab(s) {labkeys.UNREADABLE_ADVICE}"
        )


def _static_files() -> None:
    if manifest_problem() is not None:
        # The check's message names the file; the public answer does not.
        raise RuntimeError(
            "the static files manifest is missing or unreadable, so every page would "
            "answer HTTP 500: run `manage.py collectstatic --noinput` with the server's "
            "STATIC_ROOT (`manage.py check --deploy` says more)"
        )


def _background() -> dict:
    interval = settings.PORTAL_HEARTBEAT_SECONDS
    found = heartbeat.status(interval)
    seen = found.seen
    if found.state == "starting":
        raise RuntimeError(
            "starting: no heartbeat from celery beat and a worker yet; the first is due by "
            f"{found.due_by.isoformat()}"
        )
    if found.state != "running":
        raise RuntimeError(
            "no heartbeat from celery beat and a worker "
            + (f"since {seen.isoformat()}" if seen else "yet")
            + f" (expected every {interval} s)"
        )
    return {"last_seen": seen.isoformat()}


@never_cache
@require_GET
def healthz(request):
    checks = {
        "database": _timed(_database),
        "broker": _timed(_broker),
        "lab_keys": _timed(_lab_keys),
        "static_files": _timed(_static_files),
        "beat_and_workers": _timed(_background),
    }
    essential = all(checks[name]["ok"] for name in ESSENTIAL)
    everything = essential and checks["beat_and_workers"]["ok"]
    status = "ok" if everything else ("degraded" if essential else "failing")
    strict = request.GET.get("strict") in {"1", "true", "yes"}
    code = 200 if (everything or (essential and not strict)) else 503
    return JsonResponse({"status": status, "checks": checks}, status=code)

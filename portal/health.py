"""``/healthz``: whether this portal can do its work, for a load balancer or a monitor.

Answers without signing in and shows no secret: for each part, whether it answered
and how long it took. The web process is useless without its database and its broker
(nothing after a commit would happen), so either failing is HTTP 503. A stale
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

BROKER_TIMEOUT = 3.0


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


def _background() -> dict:
    interval = settings.PORTAL_HEARTBEAT_SECONDS
    seen = heartbeat.last_seen()
    if not heartbeat.is_alive(interval):
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
        "beat_and_workers": _timed(_background),
    }
    essential = checks["database"]["ok"] and checks["broker"]["ok"]
    everything = essential and checks["beat_and_workers"]["ok"]
    status = "ok" if everything else ("degraded" if essential else "failing")
    strict = request.GET.get("strict") in {"1", "true", "yes"}
    code = 200 if (everything or (essential and not strict)) else 503
    return JsonResponse({"status": status, "checks": checks}, status=code)

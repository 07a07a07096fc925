"""Writing to the audit log: one function, so every record has the same shape."""

from __future__ import annotations

from typing import Any

from tpus.models import AuditAction, AuditEvent, Lab


def client_ip(request) -> str | None:
    """The address the request came from, as Django saw it. Behind a proxy, the proxy
    is expected to set REMOTE_ADDR (for example with a trusted-proxy middleware)."""
    if request is None:
        return None
    return request.META.get("REMOTE_ADDR") or None


def record(
    action: AuditAction,
    *,
    actor=None,
    lab: Lab | None = None,
    target_user=None,
    summary: str = "",
    data: dict[str, Any] | None = None,
    request=None,
) -> AuditEvent:
    """Append one event. ``actor`` None means the portal itself did it."""
    return AuditEvent.objects.create(
        action=action,
        actor=actor,
        lab=lab,
        target_user=target_user,
        summary=summary[:300],
        data=data or {},
        ip_address=client_ip(request),
    )

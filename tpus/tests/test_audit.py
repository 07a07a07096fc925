"""The audit log is append-only and lab admins see only their own lab's."""

from __future__ import annotations

import pytest
from django.urls import reverse

from portal import audit
from tpus.models import AuditAction, AuditEvent


def test_events_cannot_be_changed_or_deleted(cast):
    event = audit.record(AuditAction.LAB_UPDATED, actor=cast.admin, lab=cast.lab)
    event.summary = "rewritten"
    with pytest.raises(TypeError, match="append-only"):
        event.save()
    with pytest.raises(TypeError, match="append-only"):
        event.delete()
    with pytest.raises(TypeError, match="append-only"):
        AuditEvent.objects.all().delete()
    with pytest.raises(TypeError, match="append-only"):
        AuditEvent.objects.update(summary="x")
    assert AuditEvent.objects.get().summary == ""


def test_a_lab_admin_sees_their_labs_events_only(client, cast):
    audit.record(AuditAction.LAB_UPDATED, actor=cast.admin, lab=cast.lab, summary="ours")
    audit.record(AuditAction.LAB_UPDATED, actor=cast.outsider, lab=cast.other_lab, summary="theirs")
    client.force_login(cast.admin)
    body = client.get(reverse("lab_audit", args=[cast.lab.slug])).content.decode()
    assert "ours" in body
    assert "theirs" not in body

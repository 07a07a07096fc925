"""The audit log: an append-only record of who did what to whom."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.audit import AuditAction


class AppendOnlyQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise TypeError("Audit events are append-only.")

    def delete(self):
        raise TypeError("Audit events are append-only.")


class AuditEvent(models.Model):
    """One thing that happened: the actor (None for the portal itself), the action,
    whom it concerned, in which lab, and details such as what a host answered."""

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    lab = models.ForeignKey(
        "tpus.Lab", null=True, blank=True, on_delete=models.PROTECT, related_name="audit_events"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
    )
    action = models.CharField(max_length=40, choices=AuditAction.choices)
    target_user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
    )
    summary = models.CharField(max_length=300, blank=True)
    data = models.JSONField(default=dict, blank=True)
    ip_address = models.GenericIPAddressField(null=True, blank=True)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # Exactly the audit log page's order, so a page is an index range, not a sort.
            models.Index(fields=["lab", "-created_at", "-id"], name="audit_lab_time"),
            # The API's order (by id, like every list): a page of one lab's log reads that
            # lab's rows only, however many events the other labs have.
            models.Index(fields=["lab", "id"], name="audit_lab_id"),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.get_action_display()}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise TypeError("Audit events are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("Audit events are append-only.")

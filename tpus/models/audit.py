"""The audit log: an append-only record of who did what to whom."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class AuditAction(models.TextChoices):
    LAB_CREATED = "lab.created", "Lab created"
    LAB_UPDATED = "lab.updated", "Lab settings changed"
    MEMBERSHIP_REQUESTED = "membership.requested", "Asked to join"
    MEMBERSHIP_APPROVED = "membership.approved", "Membership approved"
    MEMBERSHIP_REJECTED = "membership.rejected", "Membership rejected"
    MEMBERSHIP_REMOVED = "membership.removed", "Member removed"
    ROLE_CHANGED = "membership.role_changed", "Role changed"
    POLICY_ACCEPTED = "policy.accepted", "Policy accepted"
    INVITE_CREATED = "invite.created", "Invite created"
    INVITE_REVOKED = "invite.revoked", "Invite revoked"
    INVITE_ACCEPTED = "invite.accepted", "Invite accepted"
    ADMIN_LOGIN = "admin.login", "Admin signed in"
    TOKEN_CREATED = "token.created", "API token created"
    TOKEN_REVOKED = "token.revoked", "API token revoked"
    VM_IMPORTED = "vm.imported", "TPU VM imported"
    VM_REGISTERED = "vm.registered", "TPU VM registered by hand"
    VM_STATE_CHANGED = "vm.state_changed", "TPU VM state changed"
    VM_MISSING = "vm.missing", "TPU VM no longer listed"
    HOST_KEYS_PINNED = "vm.host_keys_pinned", "Host keys pinned"
    DISK_REGISTERED = "disk.registered", "Data disk registered"
    DISK_ATTACHED = "disk.attached", "Data disk attached"
    DISK_DETACHED = "disk.detached", "Data disk detached"
    DISK_OPERATION_FAILED = "disk.operation_failed", "Disk attach or detach failed"
    GRANT_CREATED = "grant.created", "Access granted"
    GRANT_ACTIVE = "grant.active", "Access in force on every worker"
    GRANT_FAILED = "grant.failed", "Access failed"
    GRANT_REVOKED = "grant.revoked", "Access revoked"
    VM_RECONCILED = "vm.reconciled", "Workers reconciled"
    HOST_KEY_CHANGED = "vm.host_key_changed", "Host key changed"
    DRIFT_FOUND = "vm.drift", "Unknown accounts found on a worker"
    IP_CHANGED = "vm.ip_changed", "External IP changed"
    WORKER_REBOOTED = "vm.worker_rebooted", "Worker rebooted"
    SSH_KEY_ADDED = "ssh_key.added", "SSH key added"
    SSH_KEY_DELETED = "ssh_key.deleted", "SSH key deleted"
    UNIX_USERNAME_CHOSEN = "unix_account.username_chosen", "Unix username chosen"


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
        indexes = [models.Index(fields=["lab", "-created_at"])]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.get_action_display()}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise TypeError("Audit events are append-only.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("Audit events are append-only.")

"""Who may use which TPU VM (grants), and what each worker last confirmed.

A grant is desired state. Every change to what a VM should look like bumps the VM's
``desired_version``; a reconcile applies one version to every worker and records it
on the worker. A grant whose version every worker has applied is in force.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class GrantState(models.TextChoices):
    PENDING = "pending", "Pending"
    ACTIVE = "active", "Active"
    REVOKING = "revoking", "Revoking"
    REVOKED = "revoked", "Revoked"
    FAILED = "failed", "Failed"


# States in which the person should be able to log in once the hosts catch up.
WANTED_STATES = (GrantState.PENDING, GrantState.ACTIVE, GrantState.FAILED)


class KindGrantState(models.TextChoices):
    ACTIVE = "active", "Active"
    REVOKED = "revoked", "Revoked"


class KindGrant(models.Model):
    """ "milo may use any v4-8 of the lab, with sudo, until June": one row per person,
    lab and accelerator type. It holds a grant (``Grant.from_kind``) on every VM of
    that type in the lab, those there now and those that join later. A revoked kind
    grant stays; granting the kind again reuses it."""

    State = KindGrantState

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="kind_grants")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="kind_grants"
    )
    accelerator_type = models.CharField(max_length=40)
    sudo = models.BooleanField(default=False)
    expires_on = models.DateField(null=True, blank=True)
    state = models.CharField(
        max_length=10, choices=KindGrantState.choices, default=KindGrantState.ACTIVE
    )
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    # When the kind was last granted: a VM grant of it that someone revoked since then
    # is not given back when its VM joins the lab again.
    granted_at = models.DateTimeField(default=timezone.now)
    changed_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "user", "accelerator_type"], name="one_kind_grant_per_type"
            )
        ]
        indexes = [models.Index(fields=["lab", "accelerator_type", "state"])]
        ordering = ["accelerator_type", "user__email"]

    def __str__(self) -> str:
        return f"{self.user} on every {self.accelerator_type} of {self.lab} ({self.state})"


class Grant(models.Model):
    """ "milo may use tpu5, with sudo, until June": one row per person and VM. A revoked
    grant stays (the account on the hosts is kept, locked); granting again reuses it."""

    State = GrantState

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="grants"
    )
    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="grants")
    sudo = models.BooleanField(default=False)
    expires_on = models.DateField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=GrantState.choices, default=GrantState.PENDING)
    # The VM's desired_version that carries this grant's latest change.
    version = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    # When the grant last changed in any way an API client can see (state, sudo, expiry,
    # error): the ``updated_since`` filter reads it.
    changed_at = models.DateTimeField(default=timezone.now)
    activated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    expiry_warned_at = models.DateTimeField(null=True, blank=True)
    # A failure the hosts may get over by themselves (a local account holding the
    # person's UID or name, which an admin removes): the sweep tries again from then on,
    # backing off with each failure.
    retry_at = models.DateTimeField(null=True, blank=True)
    failures = models.PositiveIntegerField(default=0)
    # The kind grant that made this grant (None for one given by hand): revoking the
    # kind grant revokes exactly the grants it made.
    from_kind = models.ForeignKey(
        KindGrant, null=True, blank=True, on_delete=models.SET_NULL, related_name="grants"
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "vm"], name="one_grant_per_vm")]
        indexes = [
            models.Index(fields=["vm", "state"]),
            models.Index(fields=["state"]),
            models.Index(fields=["changed_at"]),
        ]
        ordering = ["vm__name", "user__email"]

    def __str__(self) -> str:
        return f"{self.user} on {self.vm} ({self.state})"

    @property
    def is_wanted(self) -> bool:
        return self.state in WANTED_STATES


class WorkerSync(models.Model):
    """What one worker last did: the desired version it has applied, when, and the
    error of its last attempt if that failed."""

    worker = models.OneToOneField("tpus.Worker", on_delete=models.CASCADE, related_name="sync")
    applied_version = models.PositiveIntegerField(default=0)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_error_retryable = models.BooleanField(default=False)
    failures = models.PositiveIntegerField(default=0, help_text="Failed attempts in a row.")
    # A worker that failed for a reason the host can get over (the portal's account
    # lost sudo there, a script refused): when to try it again, further apart each
    # time (``reconcile.retry_delay``), so it heals soon after the fix.
    retry_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # What the host answered last time (its key=value report), for the VM page.
    last_report = models.JSONField(default=dict, blank=True)
    # Disks whose device this worker has been waiting for, since when, in this boot:
    # {"boot": boot_id, "devices": {device: ISO time}} (``services.disk_mounts``); and
    # when the worker is to be looked at again, while a device is still on its way or
    # a disk being detached is still busy (the wait is bounded).
    disk_waits = models.JSONField(default=dict, blank=True)
    disk_recheck_at = models.DateTimeField(null=True, blank=True, db_index=True)

    def __str__(self) -> str:
        return f"{self.worker}: v{self.applied_version}"

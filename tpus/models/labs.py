"""Labs (the portal's tenants), who belongs to them, and invitations."""

from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from portal.validators import validate_plain_text

# GCP project ids: 6–30 characters, lowercase letters, digits and hyphens, starting
# with a letter and not ending with a hyphen.
validate_project_id = RegexValidator(
    r"^[a-z][a-z0-9-]{4,28}[a-z0-9]\Z",
    "A GCP project id is 6–30 lowercase letters, digits or hyphens, starting with a "
    "letter and not ending with a hyphen.",
)
ZONE_PATTERN = RegexValidator(
    r"^[a-z]+-[a-z]+[0-9]+-[a-z]\Z", "A zone looks like us-central1-f or europe-west4-a."
)

DEFAULT_POLICY = (
    "These TPU VMs are granted to the lab for research only: no personal projects, "
    "no mining, nothing that breaks the terms of the grant.\n"
    "Do not run gcloud commands on the VMs; ask a lab admin first. They can disturb the "
    "other TPU VMs in the project.\n"
    "Keep your data in your home directory; shared data disks are mounted read-only."
)


def validate_zones(value: object) -> None:
    if not isinstance(value, list) or not all(isinstance(z, str) for z in value):
        raise ValidationError("Zones must be a list of zone names.")
    if len(value) > 50:
        raise ValidationError("A lab can list at most 50 zones.")
    if len(set(value)) != len(value):
        raise ValidationError("Each zone may be listed once.")
    for zone in value:
        ZONE_PATTERN(zone)


class Lab(models.Model):
    """A research lab with its own GCP project: the unit of tenancy. Everything a
    collaborator can see hangs off a lab they belong to."""

    name = models.CharField(max_length=100, validators=[validate_plain_text])
    slug = models.SlugField(max_length=50, unique=True)
    gcp_project_id = models.CharField(
        "GCP project id", max_length=30, validators=[validate_project_id]
    )
    zones = models.JSONField(default=list, blank=True, validators=[validate_zones])
    grant_end_date = models.DateField(
        null=True, blank=True, help_text="When the lab's TPU quota ends; access ends with it."
    )
    default_sudo = models.BooleanField(
        "sudo for new grants", default=False, help_text="Pre-ticks sudo on new grants."
    )
    default_agent_forwarding = models.BooleanField("agent forwarding in ssh configs", default=False)
    policy_text = models.TextField(default=DEFAULT_POLICY, max_length=10000)
    # Bumped whenever the policy text changes, so acceptance is of a known version.
    policy_version = models.PositiveIntegerField(default=1)
    discoverable = models.BooleanField(
        default=True, help_text="Listed for signed-in people to ask to join."
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Role(models.TextChoices):
    MEMBER = "member", "Member"
    ADMIN = "admin", "Lab admin"


class MembershipState(models.TextChoices):
    REQUESTED = "requested", "Requested"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"
    REMOVED = "removed", "Removed"


class Membership(models.Model):
    """A person's standing in one lab: asked to join, approved (as member or admin),
    rejected, or removed."""

    Role = Role
    State = MembershipState

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    lab = models.ForeignKey(Lab, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    state = models.CharField(
        max_length=10, choices=MembershipState.choices, default=MembershipState.REQUESTED
    )
    purpose = models.TextField(max_length=500, blank=True)
    policy_version_accepted = models.PositiveIntegerField(null=True, blank=True)
    policy_accepted_at = models.DateTimeField(null=True, blank=True)
    requested_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    decision_note = models.TextField(max_length=500, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "lab"], name="one_membership_per_lab")
        ]
        indexes = [models.Index(fields=["lab", "state"])]
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"{self.user} in {self.lab} ({self.state})"

    @property
    def is_approved(self) -> bool:
        return self.state == MembershipState.APPROVED

    @property
    def is_admin(self) -> bool:
        return self.is_approved and self.role == Role.ADMIN


def hash_invite_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class Invite(models.Model):
    """A link a lab admin sends: whoever opens it (and, when an email is set, only
    that address) joins the lab pre-approved once they accept the policy."""

    lab = models.ForeignKey(Lab, on_delete=models.CASCADE, related_name="invites")
    email = models.EmailField(blank=True, help_text="Only this address may use it.")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    digest = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    used_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"Invite to {self.lab} for {self.email or 'anyone'}"

    @staticmethod
    def generate() -> str:
        return secrets.token_urlsafe(24)

    @property
    def is_usable(self) -> bool:
        return self.used_at is None and self.revoked_at is None and self.expires_at > timezone.now()

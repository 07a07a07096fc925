"""Labs (the portal's tenants), who belongs to them, and invitations."""

from __future__ import annotations

import hashlib
import secrets
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
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


def validate_job_memory_mb(value: int) -> None:
    if value and value < 32:
        raise ValidationError("Give 0 (90% of the worker's memory) or at least 32 MB.")


MAX_TOKEN_LIFETIME_DAYS = 3650


def default_token_lifetime_days() -> int:
    """A new lab's API token lifetime: the site's (PORTAL_TOKEN_LIFETIME_DAYS)."""
    return settings.PORTAL_TOKEN_LIFETIME_DAYS


class Lab(models.Model):
    """A research lab with its own GCP project: the unit of tenancy. Everything a
    collaborator can see hangs off a lab they belong to."""

    name = models.CharField(max_length=100, validators=[validate_plain_text])
    slug = models.SlugField(max_length=50, unique=True)
    # Set by a site admin only: the project's TPU VMs are the lab's, so two labs can
    # never share one (the message does not say which lab has it).
    gcp_project_id = models.CharField(
        "GCP project id",
        max_length=30,
        unique=True,
        validators=[validate_project_id],
        error_messages={
            "unique": "This GCP project already belongs to another lab; a project can "
            "belong to one lab only."
        },
    )
    zones = models.JSONField(default=list, blank=True, validators=[validate_zones])
    grant_end_date = models.DateField(
        null=True, blank=True, help_text="When the lab's TPU quota ends; access ends with it."
    )
    default_sudo = models.BooleanField(
        "sudo for new grants", default=False, help_text="Pre-ticks sudo on new grants."
    )
    policy_text = models.TextField(default=DEFAULT_POLICY, max_length=10000)
    # Bumped whenever the policy text changes, so acceptance is of a known version.
    policy_version = models.PositiveIntegerField(default=1)
    discoverable = models.BooleanField(
        default=True, help_text="Listed for signed-in people to ask to join."
    )
    # Set by a site admin only, for at most one lab: the portal logs in to this lab's
    # workers with the site-wide PORTAL_ADMIN_SSH_KEY(_FILE) instead of the lab's own key.
    uses_site_key = models.BooleanField(
        "uses the site-wide SSH key",
        default=False,
        help_text="Log in to this lab's workers with PORTAL_ADMIN_SSH_KEY_FILE instead of "
        "the lab's own key. At most one lab; for a portal that serves a single lab.",
    )
    max_queued_jobs = models.PositiveSmallIntegerField(
        "queued jobs per person and VM",
        default=3,
        help_text="How many jobs one person may have waiting on one TPU VM; 0: no limit.",
    )
    # The pool (jobs submitted to a kind of VM, ``services.scheduler``): how many chips
    # one person's jobs may hold at once before their next waits.
    max_chips_per_person = models.PositiveIntegerField(
        "chips running at once per person",
        default=0,
        help_text="How many TPU chips one person's jobs may hold at once when jobs are "
        "placed on any free VM of a kind; 0: no limit.",
    )
    # Fair share: waiting pool jobs go in the order of their people's recent use (chip-
    # hours, halved every half-life) divided by their shares (``services.fair_share``).
    fair_share_half_life_days = models.DecimalField(
        "half-life of recent use (days)",
        max_digits=5,
        decimal_places=2,
        default=Decimal(7),
        validators=[MinValueValidator(Decimal("0.1")), MaxValueValidator(Decimal(365))],
        help_text="Waiting jobs go first for the people with the least recent use for their "
        "share; a chip-hour used this long ago counts half, twice as long ago a quarter.",
    )
    max_waiting_jobs_per_person = models.PositiveIntegerField(
        "jobs waiting at once per person",
        default=0,
        validators=[MaxValueValidator(100_000)],
        help_text="How many jobs one person may have waiting in the lab at once (for one VM "
        "or for any VM of a kind); a job past it is refused. 0: no limit.",
    )
    # Each job's cgroup on each worker (docs/jobs-host.md): what one job may take there.
    job_tasks_max = models.PositiveIntegerField(
        "tasks per job and worker",
        default=4096,
        validators=[MinValueValidator(16), MaxValueValidator(4194304)],
        help_text="Processes and threads one job may have on each worker; past it, forking fails.",
    )
    job_memory_max_mb = models.PositiveIntegerField(
        "memory per job and worker (MB)",
        default=0,
        validators=[validate_job_memory_mb, MaxValueValidator(999_999_999)],
        help_text="Past it the job's processes are killed (out of memory); 0: 90% of the "
        "worker's memory.",
    )
    job_log_max_mb = models.PositiveIntegerField(
        "log per job and worker (MB)",
        default=100,
        validators=[MinValueValidator(1), MaxValueValidator(1_000_000)],
        help_text="Past it the log ends with a line saying where it was cut; the job keeps "
        "running.",
    )
    # Workdir snapshots a job carries (``services.snapshots``): the most one snapshot
    # may hold, in MB and in files, refused before anything is stored.
    snapshot_max_mb = models.PositiveIntegerField(
        "snapshot size (MB)",
        default=1024,
        validators=[MinValueValidator(1), MaxValueValidator(1_000_000)],
        help_text="The largest workdir a job may carry to the workers (all its files).",
    )
    snapshot_max_files = models.PositiveIntegerField(
        "files per snapshot",
        default=10_000,
        validators=[MinValueValidator(1), MaxValueValidator(20_000)],
        help_text="The most files a workdir a job carries may have.",
    )
    token_lifetime_days = models.PositiveSmallIntegerField(
        "API token lifetime (days)",
        default=default_token_lifetime_days,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TOKEN_LIFETIME_DAYS)],
        help_text="API tokens (the command-line client's sign-in too) made by the lab's "
        "members expire after this long; someone in several labs gets the shortest.",
    )
    # The policy on idle chips (``services.idle_holders``): chips held with a duty cycle
    # below the threshold for the minutes to warn get their holder an email; the
    # minutes to admins after it, the lab's admins are told and, with release on, the
    # portal ends the job or the process that holds them.
    idle_policy_enabled = models.BooleanField(
        "act on idle chips",
        default=False,
        help_text="Tell whoever holds a TPU's chips without using them, then the lab's admins.",
    )
    idle_threshold_percent = models.DecimalField(
        "idle below duty cycle (%)",
        max_digits=4,
        decimal_places=1,
        default=Decimal(1),
        validators=[MinValueValidator(Decimal("0.1")), MaxValueValidator(Decimal(100))],
        help_text="Chips whose TensorCore duty cycle stays below this are idle.",
    )
    idle_warn_minutes = models.PositiveIntegerField(
        "minutes idle before the holder is told",
        default=30,
        validators=[MinValueValidator(1), MaxValueValidator(10080)],
        help_text="The holder gets one email with what they hold, 1 to 10080 (a week).",
    )
    idle_admins_minutes = models.PositiveIntegerField(
        "minutes after that before the admins are told",
        default=30,
        validators=[MinValueValidator(1), MaxValueValidator(10080)],
        help_text="Counted from the holder's email, 1 to 10080.",
    )
    idle_release = models.BooleanField(
        "release idle chips",
        default=False,
        help_text="When the admins are told, also end the job or process holding the chips.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    # The lease of the task listing the lab's zones now (``sync.sync_lab``): one at a
    # time per lab, however many beats and Refresh clicks ask.
    sync_claimed_until = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["uses_site_key"],
                condition=models.Q(uses_site_key=True),
                name="one_lab_uses_site_key",
            )
        ]

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
    # Set by a lab admin: the lab's policy on idle chips leaves this person alone.
    idle_exempt = models.BooleanField(default=False)
    # When the state, role or accepted policy last changed (the API's updated_since).
    changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "lab"], name="one_membership_per_lab")
        ]
        indexes = [
            models.Index(fields=["lab", "state"]),
            models.Index(fields=["lab", "changed_at"]),
        ]
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


class LabKey(models.Model):
    """The SSH key pair the portal logs in to one lab's TPU VM workers with. Made by the
    portal (ed25519); the private half is stored encrypted with ``PORTAL_SECRETS_KEY``
    (``portal.secrets``), never shown, never logged. Its public half goes into the
    VMs' ``ssh-keys`` metadata when a lab admin connects them."""

    lab = models.OneToOneField(Lab, on_delete=models.CASCADE, related_name="ssh_key")
    # "ssh-ed25519 <base64>", without a comment.
    public_key = models.CharField(max_length=200)
    fingerprint = models.CharField(max_length=100)
    private_key_encrypted = models.TextField(editable=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "lab SSH key"

    def __str__(self) -> str:
        return f"{self.lab}: {self.fingerprint}"

    def __repr__(self) -> str:
        return f"<LabKey {self.lab_id} {self.fingerprint}>"

    @property
    def comment(self) -> str:
        return f"tpu-portal@{self.lab.slug}"

    @property
    def public_line(self) -> str:
        """The public key as one OpenSSH line, with a comment naming the lab."""
        return f"{self.public_key} {self.comment}"

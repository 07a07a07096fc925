"""People who use the portal, and the credentials they hold."""

from __future__ import annotations

import hashlib
import secrets

from django.contrib.auth.models import AbstractBaseUser, BaseUserManager, PermissionsMixin
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone


class UserManager(BaseUserManager):
    use_in_migrations = True

    def _create(self, email: str, password: str | None, **fields) -> User:
        if not email:
            raise ValueError("A user needs an email address.")
        user = self.model(email=self.normalize_email(email).lower(), **fields)
        user.set_password(password) if password else user.set_unusable_password()
        user.save(using=self._db)
        return user

    def create_user(self, email: str, password: str | None = None, **fields) -> User:
        fields.setdefault("is_staff", False)
        fields.setdefault("is_superuser", False)
        return self._create(email, password, **fields)

    def create_superuser(self, email: str, password: str | None = None, **fields) -> User:
        fields.update(is_staff=True, is_superuser=True)
        return self._create(email, password, **fields)


class User(AbstractBaseUser, PermissionsMixin):
    """A person who signs in with an email address. Site admins are superusers; lab
    roles live on memberships."""

    email = models.EmailField("email address", max_length=254, unique=True)
    full_name = models.CharField(max_length=150, blank=True)
    is_staff = models.BooleanField(default=False)
    is_active = models.BooleanField(default=True)
    date_joined = models.DateTimeField(default=timezone.now)

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    class Meta:
        constraints = [models.UniqueConstraint(Lower("email"), name="user_email_unique_ci")]

    def __str__(self) -> str:
        return self.email

    @property
    def is_site_admin(self) -> bool:
        return self.is_active and self.is_superuser

    def get_full_name(self) -> str:
        return self.full_name or self.email

    def get_short_name(self) -> str:
        return self.full_name.split(" ")[0] if self.full_name else self.email.split("@")[0]


TOKEN_PREFIX = "tpp_"  # noqa: S105 (a marker, not a secret)


def hash_token(raw: str) -> str:
    """Tokens are 256 random bits, so one SHA-256 is enough to store them safely."""
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def live(self):
        """Tokens that still work: neither revoked nor expired."""
        return self.filter(revoked_at=None, expires_at__gt=timezone.now())


class ApiToken(models.Model):
    """A personal access token for the JSON API. Only its hash is stored; the token
    itself is shown once, when it is made."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    # The first characters, kept so people can tell their tokens apart.
    hint = models.CharField(max_length=12)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Set when it is made, from the token lifetime of the person's labs
    # (``accounts.services.token_lifetime_days``); the API refuses it from then on.
    expires_at = models.DateTimeField()

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.hint}…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired

    @property
    def is_expired(self) -> bool:
        return timezone.now() >= self.expires_at

    @staticmethod
    def generate() -> str:
        return TOKEN_PREFIX + secrets.token_urlsafe(32)


class SSHKey(models.Model):
    """A public key a person uploaded, as the strict parser (``accounts.sshkeys``)
    accepted it. Only the parsed parts are kept: the ``authorized_keys`` line is always
    rebuilt from ``key_type`` and ``blob_b64``, never copied from what was pasted. The
    original blob is kept as-is, so FIDO (``sk-``) keys survive the round trip."""

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="ssh_keys")
    label = models.CharField(max_length=100, blank=True)
    key_type = models.CharField(max_length=64)
    blob_b64 = models.TextField()
    bits = models.PositiveIntegerField()
    # "SHA256:" and 43 characters of unpadded base64, as ssh-keygen -lf prints it.
    fingerprint_sha256 = models.CharField(max_length=64)
    comment = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        verbose_name = "SSH key"
        constraints = [
            # One key belongs to one person across the whole portal: whoever holds it
            # would otherwise log in as both accounts.
            models.UniqueConstraint(fields=["fingerprint_sha256"], name="sshkey_fingerprint_unique")
        ]

    def __str__(self) -> str:
        return f"{self.key_type} {self.fingerprint_sha256}"

    # ssh-keygen -l prints the algorithm in brackets after the comment.
    _KEYGEN_NAMES = {
        "ssh-ed25519": "ED25519",
        "sk-ssh-ed25519@openssh.com": "ED25519-SK",
        "ecdsa-sha2-nistp256": "ECDSA",
        "ecdsa-sha2-nistp384": "ECDSA",
        "ecdsa-sha2-nistp521": "ECDSA",
        "sk-ecdsa-sha2-nistp256@openssh.com": "ECDSA-SK",
        "ssh-rsa": "RSA",
    }

    @property
    def algorithm(self) -> str:
        """The algorithm's name as ``ssh-keygen -l`` shows it (ED25519, RSA …)."""
        return self._KEYGEN_NAMES.get(self.key_type, self.key_type)

    @property
    def name(self) -> str:
        """What to call the key in messages: its label, else its comment, else its
        fingerprint."""
        return self.label or self.comment or self.fingerprint_sha256

    def authorized_keys_line(self, comment: str = "") -> str:
        """The line the portal writes for this key: type, canonical base64 and a
        comment the portal chose. No options, no newline."""
        from accounts.sshkeys import ParsedKey

        parsed = ParsedKey(
            key_type=self.key_type,
            blob_b64=self.blob_b64,
            bits=self.bits,
            comment="",
            fingerprint_sha256=self.fingerprint_sha256,
        )
        return parsed.authorized_keys_line(comment)


class UidAllocation(models.Model):
    """Every UID the portal has ever handed out, one row each, never deleted. New UIDs
    are always above the highest allocated one, and the primary key makes two people
    getting the same UID impossible, even when two allocations race."""

    uid = models.PositiveIntegerField(primary_key=True)
    # Kept (as NULL) when the person is deleted: the UID stays spent.
    user = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    allocated_at = models.DateTimeField(default=timezone.now)
    # The username this UID first went to hosts with. Kept, like the row, when the
    # person is deleted: their locked account and their files on the hosts still carry
    # the name, so it is never given to anyone else.
    username = models.CharField(max_length=31, blank=True)

    class Meta:
        ordering = ["uid"]
        verbose_name = "UID allocation"

    def __str__(self) -> str:
        return str(self.uid)


class UnixAccount(models.Model):
    """A person's account on the lab's machines: one username and one UID, the same
    on every worker of every TPU VM (NFS across pod workers needs equal UIDs). The
    person's group has the same name and a GID equal to the UID.

    The username may be chosen and changed freely until the account first exists on a
    host (``provisioned_at``); from then on it is fixed."""

    user = models.OneToOneField(User, on_delete=models.CASCADE, related_name="unix_account")
    # Empty until the person chooses one.
    username = models.CharField(max_length=31, blank=True)
    uid = models.PositiveIntegerField(unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    provisioned_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "unix account"
        constraints = [
            models.UniqueConstraint(
                Lower("username"),
                condition=~models.Q(username=""),
                name="unixaccount_username_unique_ci",
            )
        ]

    def __str__(self) -> str:
        return f"{self.username or '(no username yet)'} ({self.uid})"

    @property
    def gid(self) -> int:
        """Each person's group has the same number as their UID."""
        return self.uid

    @property
    def locked(self) -> bool:
        """True once the account exists on at least one host: the username is fixed."""
        return self.provisioned_at is not None


class DeviceAuthorization(models.Model):
    """A command-line client asking for a token (the OAuth device flow, RFC 8628): it
    shows the person ``user_code`` and a link, the person approves it on the portal's
    device page while signed in, and the client, polling with its ``device_code``,
    receives a token of that person once. Only the device code's hash is stored."""

    class State(models.TextChoices):
        PENDING = "pending", "Waiting for approval"
        APPROVED = "approved", "Approved"
        DENIED = "denied", "Denied"
        ISSUED = "issued", "Token issued"

    device_digest = models.CharField(max_length=64, unique=True)
    user_code = models.CharField(max_length=8, unique=True)
    device_name = models.CharField(max_length=100)
    requested_from = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    interval = models.PositiveSmallIntegerField(default=5)
    last_polled_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    user = models.ForeignKey(
        User, null=True, blank=True, on_delete=models.CASCADE, related_name="device_logins"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    token = models.ForeignKey(
        ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        indexes = [models.Index(fields=["expires_at"], name="device_auth_expires_idx")]

    def __str__(self) -> str:
        return f"{self.device_name} ({self.get_state_display()})"

    @property
    def is_expired(self) -> bool:
        return timezone.now() >= self.expires_at

    @property
    def shown_code(self) -> str:
        """``WDJBMJHT`` as people read it: ``WDJB-MJHT``."""
        return f"{self.user_code[:4]}-{self.user_code[4:]}"

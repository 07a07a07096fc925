"""Use cases about a person's SSH public keys: add one, delete one.

Views, the API and the admin all call these. Parsing is ``accounts.sshkeys``'s job;
this module adds the rules that need the database (one key, one person; a cap per
person; never the portal's own key), the audit trail, and the one call that makes
the TPU VMs follow (``tpus.services.access_changes.user_keys_changed``).

What a person pastes can be a private key. It is refused by the parser before
anything else looks at it, and the functions that hold the text are marked
sensitive, so even an unexpected error report shows none of it.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import IntegrityError, transaction
from django.views.decorators.debug import sensitive_variables

from accounts import sshmessages as msg
from accounts.models import SSHKey, User
from accounts.sshkeys import KeyRejected, ParsedKey, ensure_not_admin_key, parse_public_key
from portal import audit, people
from portal.audit import AuditAction
from portal.validators import validate_plain_text
from tpus.models import LabKey
from tpus.services import access_changes

MAX_KEYS_PER_USER = 20
LABEL_MAX_LENGTH = 100


def admin_key_fingerprints() -> list[str]:
    """SHA256 fingerprints of the portal's own administration key, from
    ``PORTAL_ADMIN_SSH_PUBLIC_KEY`` and from the ``.pub`` file next to
    ``PORTAL_ADMIN_SSH_KEY_FILE`` when there is one. Empty when neither is configured.
    Read at each call, so a rotated key counts at once."""
    sources: list[tuple[str, str]] = []
    configured = getattr(settings, "PORTAL_ADMIN_SSH_PUBLIC_KEY", "")
    if configured:
        sources.append(("PORTAL_ADMIN_SSH_PUBLIC_KEY", configured))
    private_path = getattr(settings, "PORTAL_ADMIN_SSH_KEY_FILE", "")
    if private_path:
        public_path = Path(f"{private_path}.pub")
        try:
            sources.append((str(public_path), public_path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as exc:
            raise ImproperlyConfigured(f"{public_path} cannot be read: {exc}") from None
    fingerprints = []
    for where, text in sources:
        try:
            fingerprints.append(parse_public_key(text).fingerprint_sha256)
        except KeyRejected as exc:
            raise ImproperlyConfigured(
                f"The admin public key in {where} is not usable: {exc.message}"
            ) from None
    return fingerprints


def _clean_label(label: str) -> str:
    label = (label or "").strip()
    if len(label) > LABEL_MAX_LENGTH:
        raise KeyRejected("label", msg.LABEL_TOO_LONG)
    try:
        validate_plain_text(label)
    except ValidationError as exc:
        raise KeyRejected("label", "Label: " + exc.messages[0]) from None
    return label


def _refuse_existing(user: User, existing: SSHKey) -> None:
    if existing.user_id == user.pk:
        raise KeyRejected("duplicate", msg.duplicate(existing.name))
    # Whose key it is stays unsaid: that would tell a stranger who holds it.
    raise KeyRejected("in_use", msg.IN_USE)


# Hides every local variable of this call and of everything it calls (the parser's
# frames hold the text too) from Django's error reports.
@sensitive_variables()
def add_key(user: User, text: str, label: str = "", request=None) -> SSHKey:
    """Add the public key in ``text`` (as pasted or read from a file) to ``user``'s
    keys, or raise ``KeyRejected`` with a code and a message for the person: any of
    the parser's refusals, ``label``, ``admin_key``, ``duplicate``, ``in_use`` or
    ``too_many_keys``."""
    parsed = parse_public_key(text)
    label = _clean_label(label)
    ensure_not_admin_key(parsed, admin_key_fingerprints())
    if LabKey.objects.filter(fingerprint=parsed.fingerprint_sha256).exists():
        # One of the portal's own lab keys: never a person's key.
        ensure_not_admin_key(parsed, [parsed.fingerprint_sha256])
    with transaction.atomic():
        # One add at a time per person, so the cap holds under concurrent requests.
        User.objects.select_for_update().filter(pk=user.pk).first()
        existing = SSHKey.objects.filter(fingerprint_sha256=parsed.fingerprint_sha256).first()
        if existing is not None:
            _refuse_existing(user, existing)
        if SSHKey.objects.filter(user=user).count() >= MAX_KEYS_PER_USER:
            raise KeyRejected("too_many_keys", msg.too_many_keys(MAX_KEYS_PER_USER))
        key = _insert(user, parsed, label)
        _record(AuditAction.SSH_KEY_ADDED, user, key, request)
        _keys_changed(user)
    return key


def _insert(user: User, parsed: ParsedKey, label: str) -> SSHKey:
    try:
        with transaction.atomic():
            return SSHKey.objects.create(
                user=user,
                label=label,
                key_type=parsed.key_type,
                blob_b64=parsed.blob_b64,
                bits=parsed.bits,
                fingerprint_sha256=parsed.fingerprint_sha256,
                comment=parsed.comment,
            )
    except IntegrityError:
        # Someone added the same key between the check above and this insert; the
        # unique constraint caught it.
        existing = SSHKey.objects.filter(fingerprint_sha256=parsed.fingerprint_sha256).first()
        if existing is None:
            raise
        _refuse_existing(user, existing)
        raise


def delete_key(user: User, key: SSHKey, request=None, *, actor: User | None = None) -> None:
    """Delete one of ``user``'s keys. Deleting a key that is already gone is fine and
    changes nothing. ``actor`` is who did it when not the owner (a site admin)."""
    with transaction.atomic():
        deleted, _ = SSHKey.objects.filter(pk=key.pk, user=user).delete()
        if not deleted:
            return
        _record(AuditAction.SSH_KEY_DELETED, user, key, request, actor=actor)
        _keys_changed(user)


def _record(action: AuditAction, user: User, key: SSHKey, request, actor=None) -> None:
    audit.record(
        action,
        actor=actor or user,
        target_user=user,
        summary=f"{key.algorithm} {key.fingerprint_sha256}",
        data={
            "fingerprint": key.fingerprint_sha256,
            "key_type": key.key_type,
            "bits": key.bits,
            "label": key.label,
        },
        request=request,
    )


def _keys_changed(user: User) -> None:
    people.changed()
    access_changes.user_keys_changed(user)

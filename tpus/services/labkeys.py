"""Each lab's own SSH key pair, and the login the remote door uses for a lab's workers.

The portal never logs in to a lab's workers with anything but that lab's key (or, for
the one lab a site admin marked, the site-wide key from settings). A host that was
never given lab A's public key therefore cannot be changed by lab A, whatever rows
exist in the database: the tenant boundary holds on the host, not only in queries.
"""

from __future__ import annotations

import base64
import functools
import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.conf import settings
from django.db import IntegrityError, transaction

from portal import audit, secrets
from tpus.models import AuditAction, Lab, LabKey, Worker
from tpus.remote import Login, site_login
from tpus.remote.config import private_key_from_text
from tpus.services.hosts import forget_connections


def fingerprint(public_key: str) -> str:
    """OpenSSH's ``SHA256:…`` fingerprint of a ``type base64`` public key."""
    blob = base64.b64decode(public_key.split()[1])
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


def _generate(lab: Lab) -> LabKey:
    private = ed25519.Ed25519PrivateKey.generate()
    private_text = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = (
        private.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    return LabKey(
        lab=lab,
        public_key=public,
        fingerprint=fingerprint(public),
        private_key_encrypted=secrets.encrypt(private_text),
    )


def lab_key(lab: Lab) -> LabKey:
    """The lab's key pair, made the first time it is needed (labs created before
    per-lab keys get theirs on first use). Safe when two processes ask at once."""
    existing = LabKey.objects.filter(lab=lab).first()
    if existing is not None:
        existing.lab = lab  # the caller's, not a second query for it
        return existing
    key = _generate(lab)
    try:
        with transaction.atomic():
            key.save()
    except IntegrityError:  # another process made it first: use theirs
        return LabKey.objects.get(lab=lab)
    return key


class LabKeyError(ValueError):
    """A change to how the portal logs in to a lab was refused; the message says why."""


def set_uses_site_key(site_admin, lab: Lab, on: bool, *, request=None) -> None:
    """A site admin lets one lab (at most) use the site-wide key, or takes it back.
    Every VM of the lab is reconciled with the new login at the next change."""
    if not site_admin.is_site_admin:
        raise LabKeyError("Only site admins choose which key a lab uses.")
    if on and Lab.objects.filter(uses_site_key=True).exclude(pk=lab.pk).exists():
        raise LabKeyError("Another lab already uses the site-wide SSH key; at most one may.")
    if lab.uses_site_key == on:
        return
    try:
        with transaction.atomic():
            Lab.objects.filter(pk=lab.pk).update(uses_site_key=on)
            forget_connections(Worker.objects.filter(vm__lab=lab))
    except IntegrityError:
        raise LabKeyError(
            "Another lab already uses the site-wide SSH key; at most one may."
        ) from None
    lab.uses_site_key = on
    audit.record(
        AuditAction.LAB_UPDATED,
        actor=site_admin,
        lab=lab,
        summary="uses the site-wide SSH key" if on else "uses its own SSH key",
        data={"uses_site_key": on},
        request=request,
    )


def login_for(lab: Lab) -> Login:
    """How the remote door logs in to this lab's workers."""
    if lab.uses_site_key:
        return site_login()
    key = lab_key(lab)
    return Login(settings.PORTAL_LAB_SSH_USER, _private_key(key.private_key_encrypted))


@functools.lru_cache(maxsize=64)
def _private_key(token: str):
    # Keyed by the ciphertext: a re-encrypted or replaced key is a new entry.
    return private_key_from_text(secrets.decrypt(token).decode())


def is_lab_public_key(fingerprint_sha256: str) -> bool:
    """Whether this fingerprint is one of the portal's lab keys (never a person's key)."""
    return LabKey.objects.filter(fingerprint=fingerprint_sha256).exists()


def unreadable_keys() -> int:
    """How many labs' stored private keys neither PORTAL_SECRETS_KEY nor any of
    PORTAL_SECRETS_OLD_KEYS decrypts: the portal cannot log in to those labs' workers
    (the key was changed without listing the old one). ImproperlyConfigured when the
    configured keys are missing or malformed."""
    unreadable = 0
    for token in LabKey.objects.values_list("private_key_encrypted", flat=True).iterator():
        try:
            secrets.decrypt(token)
        except secrets.SecretUnreadable:
            unreadable += 1
    return unreadable


UNREADABLE_ADVICE = (
    "cannot be decrypted with PORTAL_SECRETS_KEY or any of PORTAL_SECRETS_OLD_KEYS, so "
    "the portal cannot log in to those labs' TPU VMs: restore the key they were "
    "encrypted with, or list it in PORTAL_SECRETS_OLD_KEYS (then run "
    "`manage.py rotate_secrets`)."
)


def reencrypt_all() -> int:
    """Encrypt every stored private key again with the current PORTAL_SECRETS_KEY;
    returns how many were rewritten. Run after rotating the key."""
    count = 0
    for key in LabKey.objects.only("pk", "private_key_encrypted").iterator():
        token = secrets.reencrypt(key.private_key_encrypted)
        if token != key.private_key_encrypted:
            LabKey.objects.filter(pk=key.pk).update(private_key_encrypted=token)
            count += 1
    return count

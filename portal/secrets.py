"""Encryption at rest for the few secrets the portal keeps in its database (each lab's
SSH private key), with Fernet from ``cryptography``.

``PORTAL_SECRETS_KEY`` encrypts; it and every key in ``PORTAL_SECRETS_OLD_KEYS``
decrypt, so a key can be rotated without downtime: deploy the new key with the old one
listed as old, run ``manage.py rotate_secrets``, then drop the old key. Read from
settings at each use, never copied into a module constant.
"""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class SecretUnreadable(Exception):
    """A stored secret cannot be decrypted with any configured key (the key was lost
    or changed without listing the old one)."""


def _fernet(raw: str, name: str) -> Fernet:
    try:
        return Fernet(raw.encode() if isinstance(raw, str) else raw)
    except (ValueError, TypeError):
        raise ImproperlyConfigured(
            f"{name} must be a Fernet key: 32 url-safe base64-encoded bytes "
            '(python -c "from cryptography.fernet import Fernet; '
            'print(Fernet.generate_key().decode())").'
        ) from None


def _keys() -> MultiFernet:
    primary = getattr(settings, "PORTAL_SECRETS_KEY", "")
    if not primary:
        raise ImproperlyConfigured("Set PORTAL_SECRETS_KEY (or PORTAL_SECRETS_KEY_FILE).")
    old = getattr(settings, "PORTAL_SECRETS_OLD_KEYS", [])
    return MultiFernet(
        [_fernet(primary, "PORTAL_SECRETS_KEY")]
        + [_fernet(key, "PORTAL_SECRETS_OLD_KEYS") for key in old]
    )


def check_configured() -> None:
    """Raise ImproperlyConfigured when the keys are missing or malformed."""
    _keys()


def encrypt(data: bytes) -> str:
    """``data`` encrypted and authenticated with the current key, as ASCII text."""
    return _keys().encrypt(data).decode("ascii")


def decrypt(token: str) -> bytes:
    """The plaintext of ``token``; SecretUnreadable when no configured key opens it."""
    try:
        return _keys().decrypt(token.encode("ascii"))
    except (InvalidToken, UnicodeEncodeError):
        raise SecretUnreadable(
            "a stored secret cannot be decrypted with PORTAL_SECRETS_KEY or any of "
            "PORTAL_SECRETS_OLD_KEYS"
        ) from None


def reencrypt(token: str) -> str:
    """``token`` encrypted again with the current key (for rotation)."""
    try:
        return _keys().rotate(token.encode("ascii")).decode("ascii")
    except InvalidToken:
        raise SecretUnreadable("a stored secret cannot be decrypted for rotation") from None

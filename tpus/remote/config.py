"""The door's settings, read from Django settings at each use (never at import)."""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass, field

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Login:
    """Who the door logs in as on a worker: an account and its private key. Each lab
    has its own (``tpus.services.labkeys.login_for``), so a host that was never given
    a lab's public key cannot be changed on that lab's behalf."""

    user: str
    key: paramiko.PKey = field(repr=False)

    def __repr__(self) -> str:
        return f"Login({self.user!r}, {self.key.get_name()} {self.key.fingerprint})"


@dataclass(frozen=True)
class RemoteConfig:
    connect_timeout: float
    auth_timeout: float
    script_timeout: float
    max_parallel: int
    dry_run: bool
    keep_seconds: float = 0.0
    keep_shell: bool = False


def current() -> RemoteConfig:
    return RemoteConfig(
        connect_timeout=float(settings.PORTAL_REMOTE_CONNECT_TIMEOUT),
        auth_timeout=float(settings.PORTAL_REMOTE_AUTH_TIMEOUT),
        script_timeout=float(settings.PORTAL_REMOTE_SCRIPT_TIMEOUT),
        max_parallel=int(settings.PORTAL_REMOTE_MAX_PARALLEL),
        dry_run=bool(settings.PORTAL_REMOTE_DRY_RUN),
        keep_seconds=float(settings.PORTAL_REMOTE_KEEP_SECONDS),
        keep_shell=bool(settings.PORTAL_REMOTE_KEEP_SHELL),
    )


def site_login() -> Login:
    """The site-wide key from settings, as ``PORTAL_ADMIN_SSH_USER``: only for the one
    lab a site admin marked as using it (and for tests of the scripts themselves)."""
    return Login(settings.PORTAL_ADMIN_SSH_USER, admin_key())


def private_key_from_text(text: str) -> paramiko.PKey:
    """A paramiko key from OpenSSH or PEM private key text (unencrypted)."""
    return _key_from_text(text)


def admin_key() -> paramiko.PKey:
    """The portal's admin private key, from ``PORTAL_ADMIN_SSH_KEY_FILE`` (read again
    when the file changes, so a rotated key needs no restart) or ``PORTAL_ADMIN_SSH_KEY``."""
    path = getattr(settings, "PORTAL_ADMIN_SSH_KEY_FILE", "")
    text = getattr(settings, "PORTAL_ADMIN_SSH_KEY", "")
    if path and text:
        raise ImproperlyConfigured(
            "Set PORTAL_ADMIN_SSH_KEY or PORTAL_ADMIN_SSH_KEY_FILE, not both."
        )
    if path:
        try:
            info = os.stat(path)
        except OSError as exc:
            raise ImproperlyConfigured(f"PORTAL_ADMIN_SSH_KEY_FILE={path}: {exc}") from None
        return _key_from_file(str(path), info.st_mtime_ns, info.st_size)
    if text:
        return _key_from_text(text)
    raise ImproperlyConfigured("Set PORTAL_ADMIN_SSH_KEY_FILE (or PORTAL_ADMIN_SSH_KEY).")


@functools.lru_cache(maxsize=4)
def _key_from_file(path: str, mtime_ns: int, size: int) -> paramiko.PKey:
    try:
        with open(path) as handle:
            return _key_from_text(handle.read())
    except OSError as exc:
        raise ImproperlyConfigured(f"PORTAL_ADMIN_SSH_KEY_FILE={path}: {exc}") from None


@functools.lru_cache(maxsize=4)
def _key_from_text(text: str) -> paramiko.PKey:
    data = text.strip().encode() + b"\n"
    try:
        try:
            loaded = serialization.load_ssh_private_key(data, password=None)
        except ValueError:
            loaded = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"The admin SSH key cannot be read: {exc}") from None
    if isinstance(loaded, ed25519.Ed25519PrivateKey):
        key_class = paramiko.Ed25519Key
    elif isinstance(loaded, ec.EllipticCurvePrivateKey):
        key_class = paramiko.ECDSAKey
    elif isinstance(loaded, rsa.RSAPrivateKey):
        key_class = paramiko.RSAKey
    else:
        raise ImproperlyConfigured("The admin SSH key must be ed25519, ECDSA or RSA.")
    return key_class.from_private_key(io.StringIO(data.decode()))

"""Typed readers for environment variables.

Every setting that comes from the environment goes through one of these, so a typo in
a deployment fails loudly at start-up (``ImproperlyConfigured``) instead of quietly
running with a default. Secrets also accept a ``NAME_FILE`` variant that points at a
file holding the value (Docker/Kubernetes secrets, systemd credentials).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def string(name: str, default: str | None = None) -> str:
    """A required string, or ``default`` when unset; empty counts as unset."""
    value = _raw(name)
    if value:
        return value
    if default is None:
        raise ImproperlyConfigured(f"Set the environment variable {name}.")
    return default


def boolean(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, not {value!r}.")


def integer(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {value!r}.") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {number}.")
    return number


def listing(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; blanks around items are dropped."""
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def secret(name: str, default: str | None = None) -> str:
    """A secret from ``NAME`` or from the file named by ``NAME_FILE`` (not both)."""
    direct = _raw(name)
    path = _raw(f"{name}_FILE")
    if direct and path:
        raise ImproperlyConfigured(f"Set {name} or {name}_FILE, not both.")
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={path} cannot be read: {exc}") from None
        if not value:
            raise ImproperlyConfigured(f"{name}_FILE={path} is empty.")
        return value
    if direct:
        return direct
    if default is None:
        raise ImproperlyConfigured(f"Set {name} or {name}_FILE.")
    return default


def database(url: str) -> dict:
    """Django DATABASES entry from ``sqlite:///path`` or ``postgres://user:pw@host:port/db``."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc or not path.startswith("/") or path == "/":
            raise ImproperlyConfigured(
                f"DATABASE_URL {url!r}: use sqlite:////absolute/path.sqlite3 (four slashes)."
            )
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path,
            # WAL lets the web process read while the worker writes. IMMEDIATE: a
            # transaction takes the write lock when it begins, so one that read first
            # waits (up to the timeout) for another writer instead of failing at once
            # with "database is locked" when it comes to write.
            "OPTIONS": {
                "init_command": "PRAGMA journal_mode=WAL;",
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
            },
        }
    if parts.scheme in {"postgres", "postgresql"}:
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no database.")
        options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": options,
        }
    raise ImproperlyConfigured(
        f"DATABASE_URL scheme {parts.scheme!r} is not supported; use sqlite or postgres."
    )


def email(url: str) -> dict:
    """Django email settings from ``console:``, ``file:///dir``, ``locmem:`` or
    ``smtp://user:pw@host:port`` (``smtps://`` for implicit TLS, ``?starttls=1``)."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "console":
        return {"EMAIL_BACKEND": "django.core.mail.backends.console.EmailBackend"}
    if scheme == "locmem":
        return {"EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend"}
    if scheme == "file":
        if not parts.path.startswith("/"):
            raise ImproperlyConfigured(f"EMAIL_URL {url!r}: use file:///absolute/dir.")
        return {
            "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
            "EMAIL_FILE_PATH": unquote(parts.path),
        }
    if scheme in {"smtp", "smtps"}:
        if not parts.hostname:
            raise ImproperlyConfigured(f"EMAIL_URL {url!r} names no host.")
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        starttls = query.get("starttls", "0").lower() in _TRUE
        return {
            "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
            "EMAIL_HOST": parts.hostname,
            "EMAIL_PORT": parts.port or (465 if scheme == "smtps" else 25),
            "EMAIL_HOST_USER": unquote(parts.username or ""),
            "EMAIL_HOST_PASSWORD": unquote(parts.password or ""),
            "EMAIL_USE_SSL": scheme == "smtps",
            "EMAIL_USE_TLS": starttls,
            "EMAIL_TIMEOUT": 15,
        }
    raise ImproperlyConfigured(
        f"EMAIL_URL scheme {scheme!r} is not supported; use console, file, locmem, smtp or smtps."
    )

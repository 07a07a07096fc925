"""A developer's machine and the quick start: SQLite, the embedded broker, mail on
the console. Everything can still be overridden by the environment."""

import secrets

from portal import env
from portal.logs import quiet_periodic_tasks
from portal.settings.base import *  # noqa: F403
from portal.settings.base import VAR_DIR

DEBUG = env.boolean("DEBUG", True)


def _local_secret_key() -> str:
    """A random key made once per checkout and kept in var/, so sessions survive
    restarts without anyone committing a key."""
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


def _local_secrets_key() -> str:
    """The Fernet key for secrets kept in the database, made once per checkout like
    the secret key above (losing it loses the labs' SSH keys: they would be made anew)."""
    path = VAR_DIR / "secrets_key"
    if not path.exists():
        from cryptography.fernet import Fernet

        path.write_bytes(Fernet.generate_key())
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = env.secret("SECRET_KEY", "") or _local_secret_key()
PORTAL_SECRETS_KEY = env.secret("PORTAL_SECRETS_KEY", "") or _local_secrets_key()
PORTAL_REQUIRE_ADMIN_MFA = env.boolean("PORTAL_REQUIRE_ADMIN_MFA", False)
# No SMTP server unless EMAIL_URL names one: each message is printed on the console
# (framed, its text decoded) and kept as a file of its own in var/mail/, and the pages
# that say "we sent you an email" say where it went (portal.localmail).
if EMAIL_BACKEND == "django.core.mail.backends.console.EmailBackend":  # noqa: F405
    EMAIL_BACKEND = "portal.localmail.ConsoleAndFileBackend"
    EMAIL_FILE_PATH = str(VAR_DIR / "mail")
# Celery's routine lines about periodic tasks (beat's "Sending due task poll-jobs" and
# the worker's "received" and "succeeded", every few seconds) would bury that email.
PORTAL_LOG_PERIODIC_TASKS = env.boolean("PORTAL_LOG_PERIODIC_TASKS", False)
if not PORTAL_LOG_PERIODIC_TASKS:
    LOGGING = quiet_periodic_tasks(LOGGING)  # noqa: F405

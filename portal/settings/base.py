"""Settings shared by every environment.

Values that differ between deployments are read from typed environment variables
(``portal.env``); ``local``, ``test`` and ``production`` only choose defaults.
"""

from pathlib import Path

from portal import env

BASE_DIR = Path(__file__).resolve().parent.parent.parent
# Runtime state of a local install: the SQLite database, the embedded broker's file,
# the file cache, sent mail. Never committed.
VAR_DIR = Path(env.string("PORTAL_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = False
SECRET_KEY = env.secret("SECRET_KEY", "")  # each environment insists on its own
ALLOWED_HOSTS = env.listing("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])
SITE_URL = env.string("SITE_URL", "http://127.0.0.1:8000").rstrip("/")
CSRF_TRUSTED_ORIGINS = env.listing("CSRF_TRUSTED_ORIGINS", [SITE_URL])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "allauth",
    "allauth.account",
    "allauth.mfa",
    "ninja",
    "accounts",
    "tpus",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "allauth.account.middleware.AccountMiddleware",
    "accounts.middleware.RequireAdminMFAMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"
ASGI_APPLICATION = "portal.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context_processors.site",
            ],
        },
    },
]

DATABASES = {
    "default": env.database(env.string("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"))
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_USER_MODEL = "accounts.User"
AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "allauth.account.auth_backends.AuthenticationBackend",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 10},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "account_login"
LOGIN_REDIRECT_URL = "dashboard"

# A shared cache: allauth's rate limits must count across processes, so never locmem.
_CACHE_URL = env.string("CACHE_URL", f"file://{VAR_DIR / 'cache'}")
if _CACHE_URL.startswith(("redis://", "rediss://")):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": _CACHE_URL,
            "KEY_PREFIX": env.string("CACHE_KEY_PREFIX", "portal"),
        }
    }
elif _CACHE_URL.startswith("file://"):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": _CACHE_URL.removeprefix("file://"),
        }
    }
else:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(f"CACHE_URL {_CACHE_URL!r}: use redis://… or file:///dir.")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env.string("STATIC_ROOT", str(VAR_DIR / "static")))
STATICFILES_DIRS = [BASE_DIR / "static"]

# --- Email ------------------------------------------------------------------------
globals().update(env.email(env.string("EMAIL_URL", "console:")))
DEFAULT_FROM_EMAIL = env.string("DEFAULT_FROM_EMAIL", "TPU Portal <portal@localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

# --- Accounts (django-allauth) ----------------------------------------------------
ACCOUNT_LOGIN_METHODS = {"email"}
ACCOUNT_SIGNUP_FIELDS = ["email*", "password1*", "password2*"]
ACCOUNT_USER_MODEL_USERNAME_FIELD = None
ACCOUNT_UNIQUE_EMAIL = True
ACCOUNT_EMAIL_VERIFICATION = "mandatory"
ACCOUNT_CONFIRM_EMAIL_ON_GET = False
ACCOUNT_LOGIN_ON_EMAIL_CONFIRMATION = True
ACCOUNT_LOGOUT_ON_PASSWORD_CHANGE = False
ACCOUNT_ADAPTER = "accounts.adapter.AccountAdapter"
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[TPU Portal] "
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https" if SITE_URL.startswith("https") else "http"
# allauth's defaults (login 30/m/ip, failed logins 10/m/ip and 5/5m per account,
# signup 20/m/ip, …) stay on; they count in the shared cache above.
MFA_SUPPORTED_TYPES = ["totp", "recovery_codes"]
MFA_TOTP_ISSUER = "TPU Portal"
# Site admins and lab admins must have TOTP before they can use the portal.
PORTAL_REQUIRE_ADMIN_MFA = env.boolean("PORTAL_REQUIRE_ADMIN_MFA", True)

# --- API (django-ninja) ----------------------------------------------------------
NINJA_PAGINATION_PER_PAGE = 50

# --- Celery ------------------------------------------------------------------------
# The database is the source of truth: tasks carry ids, enqueue after commit, and a
# periodic sweep re-enqueues anything stuck, so a lost message only delays work.
CELERY_BROKER_URL = env.string(
    "CELERY_BROKER_URL", f"sqla+sqlite:///{VAR_DIR / 'celery-broker.sqlite3'}"
)
# Redis redelivers an unacknowledged task after this long; tasks never legitimately
# run longer, and the same number is used wherever Celery asks for it.
CELERY_VISIBILITY_TIMEOUT = env.integer("CELERY_VISIBILITY_TIMEOUT", 3600, minimum=60)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": CELERY_VISIBILITY_TIMEOUT,
    # The embedded SQLite broker polls; half a second keeps clicks snappy.
    "polling_interval": 0.5,
}
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = CELERY_VISIBILITY_TIMEOUT - 60
CELERY_TASK_SOFT_TIME_LIMIT = CELERY_VISIBILITY_TIMEOUT - 120
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
PORTAL_HEARTBEAT_SECONDS = env.integer("PORTAL_HEARTBEAT_SECONDS", 60, minimum=1)
# How often every lab's TPU VMs are refreshed from the Cloud TPU API.
PORTAL_SYNC_SECONDS = env.integer("PORTAL_SYNC_SECONDS", 60, minimum=5)
# How often stuck provisioning is picked up again; every VM is fully reconciled (and
# checked for drift) at least every PORTAL_DRIFT_CHECK_SECONDS.
PORTAL_RECONCILE_SWEEP_SECONDS = env.integer("PORTAL_RECONCILE_SWEEP_SECONDS", 300, minimum=10)
PORTAL_DRIFT_CHECK_SECONDS = env.integer("PORTAL_DRIFT_CHECK_SECONDS", 3600, minimum=60)
PORTAL_EXPIRY_CHECK_SECONDS = env.integer("PORTAL_EXPIRY_CHECK_SECONDS", 600, minimum=10)
# One reconcile per VM at a time; if the process holding a VM dies, the claim lapses
# after this long (longer than any run: connect + script timeouts, with a margin).
PORTAL_RECONCILE_CLAIM_SECONDS = env.integer("PORTAL_RECONCILE_CLAIM_SECONDS", 420, minimum=1)

# --- Remote hosts (TPU VM workers over SSH, tpus/remote) -------------------------------
# The portal logs in to every worker as PORTAL_ADMIN_SSH_USER (passwordless sudo) with
# one private key: a file path in PORTAL_ADMIN_SSH_KEY_FILE (read again whenever the
# file changes) or the key text itself in PORTAL_ADMIN_SSH_KEY. Never in the database.
# Workers may only be contacted inside these networks (comma-separated CIDRs); empty
# means anywhere. A deployment can pin it to its VPC or its TPU VMs' ranges.
PORTAL_REMOTE_ALLOWED_NETWORKS = env.listing("PORTAL_REMOTE_ALLOWED_NETWORKS", [])
PORTAL_ADMIN_SSH_KEY_FILE = env.string("PORTAL_ADMIN_SSH_KEY_FILE", "")
PORTAL_ADMIN_SSH_KEY = env.string("PORTAL_ADMIN_SSH_KEY", "")
if PORTAL_ADMIN_SSH_KEY_FILE and PORTAL_ADMIN_SSH_KEY:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("Set PORTAL_ADMIN_SSH_KEY or PORTAL_ADMIN_SSH_KEY_FILE, not both.")
PORTAL_ADMIN_SSH_USER = env.string("PORTAL_ADMIN_SSH_USER", "admin")
# Seconds. Connect covers TCP; auth covers banner, handshake, login and opening the
# channel; script covers the whole script run. A dead VM costs at most connect.
PORTAL_REMOTE_CONNECT_TIMEOUT = env.integer("PORTAL_REMOTE_CONNECT_TIMEOUT", 10, minimum=1)
PORTAL_REMOTE_AUTH_TIMEOUT = env.integer("PORTAL_REMOTE_AUTH_TIMEOUT", 15, minimum=1)
PORTAL_REMOTE_SCRIPT_TIMEOUT = env.integer("PORTAL_REMOTE_SCRIPT_TIMEOUT", 300, minimum=1)
# Workers of one VM contacted at once (a v4-128 pod has 32).
PORTAL_REMOTE_MAX_PARALLEL = env.integer("PORTAL_REMOTE_MAX_PARALLEL", 32, minimum=1)
# Log what would run instead of connecting.
PORTAL_REMOTE_DRY_RUN = env.boolean("PORTAL_REMOTE_DRY_RUN", False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.string("LOG_LEVEL", "INFO")},
    # paramiko narrates every connection at INFO; the portal logs what matters itself.
    "loggers": {"paramiko": {"level": "WARNING"}},
}

# --- Cloud TPU API -----------------------------------------------------------------
# Read by tpus.cloud only. An empty endpoint is Google's API with application default
# credentials or the service-account key file below. The local emulator is
# TPU_API_ENDPOINT=127.0.0.1:8470 with TPU_API_INSECURE=true: plaintext, no credentials.
TPU_API_ENDPOINT = env.string("TPU_API_ENDPOINT", "")
TPU_API_INSECURE = env.boolean("TPU_API_INSECURE", False)
TPU_API_CREDENTIALS_FILE = env.string("TPU_API_CREDENTIALS_FILE", "")
TPU_API_TIMEOUT = env.integer("TPU_API_TIMEOUT", 30, minimum=1)  # seconds, each call
# Seconds to wait for a long-running operation (attaching a disk) to finish.
TPU_API_OPERATION_TIMEOUT = env.integer("TPU_API_OPERATION_TIMEOUT", 600, minimum=1)
if TPU_API_INSECURE and not TPU_API_ENDPOINT:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("TPU_API_INSECURE=true needs TPU_API_ENDPOINT (host:port).")
if TPU_API_INSECURE and TPU_API_CREDENTIALS_FILE:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "TPU_API_CREDENTIALS_FILE is not sent over an insecure channel; unset one of them."
    )

# --- Unix accounts (SSH keys, usernames, UIDs; accounts app) ---------------------------
# Every collaborator gets one UID (and a group with the same GID) from this range, the
# same on every worker of every TPU VM. A UID is never given to anyone else, even after
# its owner's account is deleted: files on shared disks keep pointing at it.
PORTAL_UID_MIN = env.integer("PORTAL_UID_MIN", 20000, minimum=1000)
PORTAL_UID_MAX = env.integer("PORTAL_UID_MAX", 59999, minimum=1000)
if PORTAL_UID_MAX < PORTAL_UID_MIN or PORTAL_UID_MAX > 2**31 - 2:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_UID_MIN..PORTAL_UID_MAX ({PORTAL_UID_MIN}..{PORTAL_UID_MAX}) is not a "
        "usable UID range: the minimum must not exceed the maximum, which must be below 2³¹−1."
    )
# The public half of the portal's own administration key, so nobody can upload it as a
# personal key. When empty, the portal looks for PORTAL_ADMIN_SSH_KEY_FILE + ".pub".
PORTAL_ADMIN_SSH_PUBLIC_KEY = env.string("PORTAL_ADMIN_SSH_PUBLIC_KEY", "")

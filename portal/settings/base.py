"""Settings shared by every environment.

Values that differ between deployments are read from typed environment variables
(``portal.env``); ``local``, ``test`` and ``production`` only choose defaults.
"""

from pathlib import Path

from portal import env
from portal.addresses import check_networks, check_trusted_proxies

BASE_DIR = Path(__file__).resolve().parent.parent.parent
# Runtime state of a local install: the SQLite database, the embedded broker's file,
# the file cache, sent mail. Never committed.
VAR_DIR = Path(env.string("PORTAL_VAR_DIR", str(BASE_DIR / "var")))
# Every process may write here (beat's schedule, the first admin's generated password),
# and a fresh clone has no var/: make it now, or say at start-up why it cannot be made.
try:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
except OSError as exc:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_VAR_DIR ({VAR_DIR}) does not exist and cannot be made: {exc.strerror}."
    ) from None

DEBUG = False
SECRET_KEY = env.secret("SECRET_KEY", "")  # each environment insists on its own
ALLOWED_HOSTS = env.listing("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])
SITE_URL = env.string("SITE_URL", "http://127.0.0.1:8000").rstrip("/")
CSRF_TRUSTED_ORIGINS = env.listing("CSRF_TRUSTED_ORIGINS", [SITE_URL])
# The proxies in front of the portal (comma-separated addresses or CIDRs): a request
# from one of them comes from the right-most X-Forwarded-For hop that is not one of
# them (portal/addresses.py). Rate limits, the audit log and the device page use it;
# empty ignores X-Forwarded-For, so each request comes from its direct peer.
PORTAL_TRUSTED_PROXIES = check_trusted_proxies(env.listing("PORTAL_TRUSTED_PROXIES", []))
# /metrics (Prometheus' format, docs/deploy.md): off unless one of these is set. A
# scrape must bring the token (``Authorization: Bearer …``), come from one of the
# networks (comma-separated addresses or CIDRs, the client address as above), or both
# when both are set.
PORTAL_METRICS_TOKEN = env.secret("PORTAL_METRICS_TOKEN", "")
PORTAL_METRICS_ALLOWED_NETWORKS = check_networks(
    "PORTAL_METRICS_ALLOWED_NETWORKS", env.listing("PORTAL_METRICS_ALLOWED_NETWORKS", [])
)
# A refused form (a stale tab, a proxy that drops Origin) lands on the portal's own page.
CSRF_FAILURE_VIEW = "portal.errors.csrf_failure"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django.forms",
    "allauth",
    "allauth.account",
    "allauth.mfa",
    "ninja",
    "portal",
    "accounts",
    "tpus",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Compresses pages and JSON. Above every middleware that reads or changes the
    # body; below WhiteNoise, which serves static files already compressed at build
    # time. Django pads compressed responses against BREACH since 4.2.
    "django.middleware.gzip.GZipMiddleware",
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
# Forms are drawn with the project's templates/django/forms/ (each field: its label,
# marked when required, the input, its help, then its errors under it), found through
# TEMPLATES; "django.forms" below supplies the rest of Django's form templates.
FORM_RENDERER = "django.forms.renderers.TemplatesSetting"
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
# The portal speaks English only. Without the translation machinery every label,
# choice name and "3 minutes ago" on a page is a plain string, not a lookup.
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env.string("STATIC_ROOT", str(VAR_DIR / "static")))
STATICFILES_DIRS = [BASE_DIR / "static"]

# --- Uploads ----------------------------------------------------------------------
# The only files people upload are SSH public keys. A file over this many bytes is
# refused as it arrives, before it is stored in memory or in a temporary file.
PORTAL_UPLOAD_MAX_BYTES = env.integer("PORTAL_UPLOAD_MAX_BYTES", 64 * 1024, minimum=1024)
FILE_UPLOAD_HANDLERS = [
    "portal.uploads.CappedUploadHandler",
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "django.core.files.uploadhandler.TemporaryFileUploadHandler",
]

# --- Email ------------------------------------------------------------------------
globals().update(env.email(env.string("EMAIL_URL", "console:")))
DEFAULT_FROM_EMAIL = env.string("DEFAULT_FROM_EMAIL", "TPU Portal <portal@localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL
# Every message is stored in the outbox (portal.models.OutboxMessage) and sent from
# there. A failed attempt is retried after PORTAL_MAIL_RETRY_SECONDS, doubling each
# time up to PORTAL_MAIL_RETRY_MAX_SECONDS; a message still unsent
# PORTAL_MAIL_GIVE_UP_SECONDS after it was written is marked failed. The sweep that
# retries runs every PORTAL_MAIL_SWEEP_SECONDS.
PORTAL_MAIL_RETRY_SECONDS = env.integer("PORTAL_MAIL_RETRY_SECONDS", 30, minimum=1)
PORTAL_MAIL_RETRY_MAX_SECONDS = env.integer("PORTAL_MAIL_RETRY_MAX_SECONDS", 1800, minimum=1)
PORTAL_MAIL_GIVE_UP_SECONDS = env.integer("PORTAL_MAIL_GIVE_UP_SECONDS", 2 * 86400, minimum=60)
PORTAL_MAIL_SWEEP_SECONDS = env.integer("PORTAL_MAIL_SWEEP_SECONDS", 30, minimum=5)
if PORTAL_MAIL_RETRY_MAX_SECONDS < PORTAL_MAIL_RETRY_SECONDS:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "PORTAL_MAIL_RETRY_MAX_SECONDS must be at least PORTAL_MAIL_RETRY_SECONDS."
    )

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
# What the portal calls itself in allauth's emails and subjects.
PORTAL_SITE_NAME = env.string("PORTAL_SITE_NAME", "TPU Portal")
ACCOUNT_EMAIL_SUBJECT_PREFIX = f"[{PORTAL_SITE_NAME}] "
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https" if SITE_URL.startswith("https") else "http"
# allauth's defaults (login 30/m/ip, failed logins 10/m/ip and 5/5m per account,
# signup 20/m/ip, …) stay on; they count in the shared cache above, per the client
# address PORTAL_TRUSTED_PROXIES gives. The device sign-in's confirmation counts as a
# failed login. The device sign-in adds its own: codes a client address asks for, and
# wrong codes typed on the device page per person and per address (past either, every
# code is refused).
ACCOUNT_RATE_LIMITS = {
    "device_code_request": "30/10m/ip",
    "device_code_wrong": "10/10m/user,30/10m/ip",
}
MFA_SUPPORTED_TYPES = ["totp", "recovery_codes"]
MFA_TOTP_ISSUER = "TPU Portal"
# API tokens (the tokens page's and the command-line client's) expire: after the
# shortest token lifetime of the labs the person belongs to (each lab admin sets it;
# a new lab starts with this), or after this many days for someone in no lab.
PORTAL_TOKEN_LIFETIME_DAYS = env.integer("PORTAL_TOKEN_LIFETIME_DAYS", 90, minimum=1)
if PORTAL_TOKEN_LIFETIME_DAYS > 3650:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_TOKEN_LIFETIME_DAYS must be at most 3650, not {PORTAL_TOKEN_LIFETIME_DAYS}."
    )
# Site admins and lab admins must have TOTP before they can use the portal.
PORTAL_REQUIRE_ADMIN_MFA = env.boolean("PORTAL_REQUIRE_ADMIN_MFA", True)

# --- API (django-ninja) ----------------------------------------------------------
NINJA_PAGINATION_PER_PAGE = 50
NINJA_PAGINATION_MAX_LIMIT = 200

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
# What tasks print (the console email backend of a local install prints every email)
# is ordinary output, not a warning.
CELERY_WORKER_REDIRECT_STDOUTS_LEVEL = "INFO"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
PORTAL_HEARTBEAT_SECONDS = env.integer("PORTAL_HEARTBEAT_SECONDS", 60, minimum=1)
# How often every lab's TPU VMs are refreshed from the Cloud TPU API.
PORTAL_SYNC_SECONDS = env.integer("PORTAL_SYNC_SECONDS", 60, minimum=5)
# A lab's admins are emailed once when listing one of its zones has failed for this
# long, and once when it works again.
PORTAL_SYNC_ALERT_SECONDS = env.integer("PORTAL_SYNC_ALERT_SECONDS", 600, minimum=0)
# Each sync also compares the host keys the Cloud TPU API publishes for this many VMs
# (one GetGuestAttributes each, the least recently compared first) with the pinned
# ones; VMs with a reason (new address, reboot, re-created) are compared on top.
PORTAL_HOST_KEY_CHECKS_PER_SYNC = env.integer("PORTAL_HOST_KEY_CHECKS_PER_SYNC", 2, minimum=0)
# A published host key that contradicts the pins is mailed to the lab's admins (the
# worker keeps being provisioned); if it changes again, at most once per this long.
PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS = env.integer(
    "PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS", 3600, minimum=0
)
# How often stuck provisioning is picked up again; every VM is fully reconciled (and
# checked for drift) at least every PORTAL_DRIFT_CHECK_SECONDS.
PORTAL_RECONCILE_SWEEP_SECONDS = env.integer("PORTAL_RECONCILE_SWEEP_SECONDS", 300, minimum=10)
# Connect a VM: how long to wait for every worker to accept the lab's key after it was
# added to the node's ssh-keys metadata (Google's guest agent applies it within
# seconds), and how often to try a worker in the meantime.
PORTAL_CONNECT_WAIT_SECONDS = env.integer("PORTAL_CONNECT_WAIT_SECONDS", 180, minimum=1)
PORTAL_CONNECT_POLL_SECONDS = env.integer("PORTAL_CONNECT_POLL_SECONDS", 3, minimum=1)
PORTAL_DRIFT_CHECK_SECONDS = env.integer("PORTAL_DRIFT_CHECK_SECONDS", 3600, minimum=60)
# Data disks: a device that a worker does not show yet (hot-plug is not instant, and a
# reboot brings it back late) is looked for again every PORTAL_DISK_RECHECK_SECONDS
# for up to PORTAL_DISK_DEVICE_WAIT_SECONDS, then shown as an error; a disk being
# detached that is still busy on a worker is tried as often for up to
# PORTAL_DISK_UNMOUNT_WAIT_SECONDS, then the detach fails and the disk stays attached.
PORTAL_DISK_RECHECK_SECONDS = env.integer("PORTAL_DISK_RECHECK_SECONDS", 5, minimum=1)
PORTAL_DISK_DEVICE_WAIT_SECONDS = env.integer("PORTAL_DISK_DEVICE_WAIT_SECONDS", 120, minimum=0)
PORTAL_DISK_UNMOUNT_WAIT_SECONDS = env.integer("PORTAL_DISK_UNMOUNT_WAIT_SECONDS", 120, minimum=0)
PORTAL_EXPIRY_CHECK_SECONDS = env.integer("PORTAL_EXPIRY_CHECK_SECONDS", 600, minimum=10)
# How often each open request for a TPU VM (waiting for capacity, provisioning) is
# looked at: one GetQueuedResource (and a GetNode once it is provisioned) each.
PORTAL_VM_REQUEST_POLL_SECONDS = env.integer("PORTAL_VM_REQUEST_POLL_SECONDS", 30, minimum=2)
# How often every elastic pool is looked at (grown for waiting jobs, its idle VMs
# deleted): an idle VM goes within this of reaching its pool's idle limit.
PORTAL_ELASTIC_POOL_SECONDS = env.integer("PORTAL_ELASTIC_POOL_SECONDS", 30, minimum=1)
# One reconcile per VM at a time (and one worker per disk operation). Its claim is a
# lease the running work renews
# every third of this; if the process holding it dies (or loses the database), the
# lease lapses after this long and the next stalled-claims check (every
# PORTAL_STALLED_CHECK_SECONDS) runs the VM again. So a dead run holds a VM for at most
# about the sum of the two, whatever the script timeout is. A revoke does not wait for
# it: it takes the VM over from any run that does not carry it (docs/reconcile.md).
PORTAL_RECONCILE_CLAIM_SECONDS = env.integer("PORTAL_RECONCILE_CLAIM_SECONDS", 30, minimum=1)
PORTAL_STALLED_CHECK_SECONDS = env.integer("PORTAL_STALLED_CHECK_SECONDS", 20, minimum=1)
# A grant a worker refused for a reason the host may get over (a local account holding
# the person's UID or name), and a worker that failed for such a reason (the portal's
# account lost sudo there), is tried again after this, doubling each time up to
# PORTAL_GRANT_RETRY_MAX_SECONDS: once the admin fixes the host, it heals
# within about that long (due tries are looked for every PORTAL_STALLED_CHECK_SECONDS),
# and a VM with refused grants gets at most one reconcile per that many seconds.
PORTAL_GRANT_RETRY_SECONDS = env.integer("PORTAL_GRANT_RETRY_SECONDS", 15, minimum=1)
PORTAL_GRANT_RETRY_MAX_SECONDS = env.integer("PORTAL_GRANT_RETRY_MAX_SECONDS", 40, minimum=1)

# --- Jobs (tpus/services/jobs.py, docs/jobs.md) -----------------------------------------
# How often the portal asks the workers of VMs with jobs how they go (one SSH exec per
# worker): the end of a job is seen within this, and the next job starts in that pass.
PORTAL_JOB_POLL_SECONDS = env.integer("PORTAL_JOB_POLL_SECONDS", 5, minimum=1)
# Cancel: TERM to the job's processes on every worker, this long to end, then KILL.
# Also how long a pod's other workers get when one of them failed.
PORTAL_JOB_CANCEL_GRACE_SECONDS = env.integer("PORTAL_JOB_CANCEL_GRACE_SECONDS", 10, minimum=0)
# The pre-flight's floor for free space in the home and available memory (MB).
PORTAL_JOB_MIN_DISK_MB = env.integer("PORTAL_JOB_MIN_DISK_MB", 1024, minimum=0)
PORTAL_JOB_MIN_MEM_MB = env.integer("PORTAL_JOB_MIN_MEM_MB", 1024, minimum=0)
# The longest one pre-flight probe run as the person may take (their environment's
# python reading its versions; realpath and sha256sum of their script) before it is
# killed and its check fails ("… did not answer within N s"). 1 to 600.
# A job run again after a preemption whose VM came back on new machines waits this
# long after the VM is whole for the person to put back what it needs in their new
# home (their environment, their script) before it is rejected.
PORTAL_JOB_RERUN_HOME_WAIT_SECONDS = env.integer(
    "PORTAL_JOB_RERUN_HOME_WAIT_SECONDS", 1800, minimum=0
)
PORTAL_JOB_PREFLIGHT_PROBE_SECONDS = env.integer(
    "PORTAL_JOB_PREFLIGHT_PROBE_SECONDS", 20, minimum=1
)
if PORTAL_JOB_PREFLIGHT_PROBE_SECONDS > 600:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_JOB_PREFLIGHT_PROBE_SECONDS must be at most 600, not "
        f"{PORTAL_JOB_PREFLIGHT_PROBE_SECONDS}."
    )
# The port of jax.distributed's coordinator on worker 0 of a pod (TPU_PORTAL_COORDINATOR).
PORTAL_JOB_COORDINATOR_PORT = env.integer("PORTAL_JOB_COORDINATOR_PORT", 8476, minimum=1024)
# A TPU VM's Python environment must have libtpu (within jax's own pin) and requests.
# Off only for hosts without TPUs, such as the test fleet's.
PORTAL_JOB_REQUIRE_LIBTPU = env.boolean("PORTAL_JOB_REQUIRE_LIBTPU", True)
# Where each TPU generation's chips appear on a worker (found without touching the
# TPU); "*" for the rest. v5e and v6e use VFIO.
PORTAL_JOB_DEVICE_GLOBS = {
    "v5litepod": "/dev/vfio/[0-9]*",
    "v5e": "/dev/vfio/[0-9]*",
    "v6e": "/dev/vfio/[0-9]*",
    "*": "/dev/accel*",
}
# Chips per worker for a VM whose accelerator type the portal does not know.
PORTAL_JOB_DEFAULT_CHIPS_PER_WORKER = env.integer(
    "PORTAL_JOB_DEFAULT_CHIPS_PER_WORKER", 4, minimum=0
)
# Opening a VM's page looks at who holds its chips again when the last look is older
# than this (at most one look per VM per this long, however many have it open).
PORTAL_JOB_USAGE_REFRESH_SECONDS = env.integer("PORTAL_JOB_USAGE_REFRESH_SECONDS", 30, minimum=0)
# The scheduled look at who holds the chips of VMs no job holds (services/holders.py):
# every PORTAL_HOLDER_PASS_SECONDS, at most PORTAL_HOLDER_PASS_VMS VMs, those looked
# at least recently first, each at most once per PORTAL_HOLDER_MAX_AGE_SECONDS. Reading
# usage (its page, its API) never looks.
PORTAL_HOLDER_PASS_SECONDS = env.integer("PORTAL_HOLDER_PASS_SECONDS", 60, minimum=1)
PORTAL_HOLDER_PASS_VMS = env.integer("PORTAL_HOLDER_PASS_VMS", 10, minimum=0)
PORTAL_HOLDER_MAX_AGE_SECONDS = env.integer("PORTAL_HOLDER_MAX_AGE_SECONDS", 1800, minimum=0)
# How much of each worker's log the portal keeps for the page (bytes); the whole log
# stays on the worker and is downloaded from there.
PORTAL_JOB_LOG_TAIL_BYTES = env.integer("PORTAL_JOB_LOG_TAIL_BYTES", 32768, minimum=1024)
# A job's folder on a worker (its log among it) is removed this many days after the job
# ended (by a job's start there, at most once an hour); 0 keeps them forever.
PORTAL_JOB_FOLDER_RETENTION_DAYS = env.integer("PORTAL_JOB_FOLDER_RETENTION_DAYS", 30, minimum=0)
# libtpu serves each chip's runtime metrics (HBM, duty cycle) over gRPC on the worker's
# local ports in TPU_RUNTIME_METRICS_PORTS, which the portal sets for every job (one
# port per process of the job on a worker, 8431 first as on a TPU VM). The job poll
# reads them in its status exec (empty: no job gets the variable and no poll reads
# metrics); it reads a VM's at most about once per PORTAL_CHIP_METRICS_EVERY_SECONDS
# (one job poll in two by default) and keeps each chip's samples this many minutes.
PORTAL_CHIP_METRICS_PORTS = env.listing(
    "PORTAL_CHIP_METRICS_PORTS", ["8431", "8432", "8433", "8434"]
)
if (
    not all(p.isdigit() and 1024 <= int(p) <= 65535 for p in PORTAL_CHIP_METRICS_PORTS)
    or len(set(PORTAL_CHIP_METRICS_PORTS)) != len(PORTAL_CHIP_METRICS_PORTS)
    or len(PORTAL_CHIP_METRICS_PORTS) > 8
):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "PORTAL_CHIP_METRICS_PORTS is empty or up to 8 distinct ports from 1024 to 65535, "
        f"comma-separated, not {','.join(PORTAL_CHIP_METRICS_PORTS)!r}."
    )
PORTAL_CHIP_METRICS_KEEP_MINUTES = env.integer("PORTAL_CHIP_METRICS_KEEP_MINUTES", 60, minimum=1)
PORTAL_CHIP_METRICS_EVERY_SECONDS = env.integer("PORTAL_CHIP_METRICS_EVERY_SECONDS", 10, minimum=1)
# The labs' policy on idle chips (services/idle_holders.py): how often the pass reads the
# kept samples, how many held VMs one run looks at (least recently first), and how long
# a process outside the portal has between TERM and KILL when the policy releases it.
PORTAL_IDLE_PASS_SECONDS = env.integer("PORTAL_IDLE_PASS_SECONDS", 60, minimum=1)
PORTAL_IDLE_PASS_VMS = env.integer("PORTAL_IDLE_PASS_VMS", 200, minimum=1)
PORTAL_IDLE_RELEASE_GRACE_SECONDS = min(
    600, env.integer("PORTAL_IDLE_RELEASE_GRACE_SECONDS", 30, minimum=0)
)

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
# Each lab has its own SSH key pair, made by the portal; the private half is kept in the
# database encrypted with PORTAL_SECRETS_KEY. The portal logs in to a lab's workers only
# with that lab's key, as this account, which Google's guest agent creates (with sudo)
# from the node's ssh-keys metadata when a lab admin connects the VM. The site-wide key
# above is only used for the one lab a site admin explicitly marks "uses the site key".
PORTAL_LAB_SSH_USER = env.string("PORTAL_LAB_SSH_USER", "tpu-portal")
# Seconds. Connect covers TCP; auth covers banner, handshake, login and opening the
# channel; script covers the whole script run. A dead VM costs at most connect.
PORTAL_REMOTE_CONNECT_TIMEOUT = env.integer("PORTAL_REMOTE_CONNECT_TIMEOUT", 10, minimum=1)
PORTAL_REMOTE_AUTH_TIMEOUT = env.integer("PORTAL_REMOTE_AUTH_TIMEOUT", 15, minimum=1)
PORTAL_REMOTE_SCRIPT_TIMEOUT = env.integer("PORTAL_REMOTE_SCRIPT_TIMEOUT", 300, minimum=1)
# Workers of one VM contacted at once (a v4-128 pod has 32).
PORTAL_REMOTE_MAX_PARALLEL = env.integer("PORTAL_REMOTE_MAX_PARALLEL", 32, minimum=1)
# Seconds a connection to a worker stays open unused after its last run, for the next
# run to the same worker (address, port, login and pinned host keys alike) to use
# instead of logging in again; 0 closes each when its runs are over.
PORTAL_REMOTE_KEEP_SECONDS = env.integer("PORTAL_REMOTE_KEEP_SECONDS", 60, minimum=0)
# On a kept connection, one root shell (started with sudo once) runs the connection's
# later scripts, each sent to it on stdin, instead of a new exec with its own sudo each
# (tpus/remote/ssh.py); the worker's sudo log then has one line per connection, not
# one per script. Off: every script in an exec of its own.
PORTAL_REMOTE_KEEP_SHELL = env.boolean("PORTAL_REMOTE_KEEP_SHELL", True)
# Log what would run instead of connecting.
PORTAL_REMOTE_DRY_RUN = env.boolean("PORTAL_REMOTE_DRY_RUN", False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Request logs show the ssh-config refresh URL with its token replaced.
    "filters": {
        "redact_feed_tokens": {"()": "portal.logs.RedactFeedTokens"},
        "quiet_permission_denied": {"()": "portal.logs.QuietPermissionDenied"},
    },
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "django.server": {
            "()": "django.utils.log.ServerFormatter",
            "format": "[{server_time}] {message}",
            "style": "{",
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["redact_feed_tokens"],
        },
        "django.server": {
            "class": "logging.StreamHandler",
            "formatter": "django.server",
            "filters": ["redact_feed_tokens"],
        },
    },
    "root": {"handlers": ["console"], "level": env.string("LOG_LEVEL", "INFO")},
    "loggers": {
        # paramiko narrates every connection at INFO; the portal logs what matters itself.
        "paramiko": {"level": "WARNING"},
        # Filters on the loggers rewrite the record itself, for every handler after them.
        "django.server": {
            "handlers": ["django.server"],
            "level": "INFO",
            "propagate": False,
            "filters": ["redact_feed_tokens"],
        },
        "django.request": {"filters": ["redact_feed_tokens", "quiet_permission_denied"]},
    },
}

# --- Secrets kept in the database (each lab's SSH private key) ---------------------
# A Fernet key (32 url-safe base64 bytes, `python -c "from cryptography.fernet import
# Fernet; print(Fernet.generate_key().decode())"`). To rotate: put the new key in
# PORTAL_SECRETS_KEY, the old one in PORTAL_SECRETS_OLD_KEYS, run
# `manage.py rotate_secrets`, then drop the old key. Each environment sets its own.
PORTAL_SECRETS_KEY = env.secret("PORTAL_SECRETS_KEY", "")
PORTAL_SECRETS_OLD_KEYS = env.listing("PORTAL_SECRETS_OLD_KEYS", [])

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
# The default lies clear of what useradd, Google's guest agent, systemd and subordinate
# ids hand out (portal/idranges.py); a range that overlaps them is refused here.
PORTAL_UID_MIN = env.integer("PORTAL_UID_MIN", 70000, minimum=1000)
PORTAL_UID_MAX = env.integer("PORTAL_UID_MAX", 99999, minimum=1000)
if PORTAL_UID_MAX < PORTAL_UID_MIN or PORTAL_UID_MAX > 2**31 - 2:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_UID_MIN..PORTAL_UID_MAX ({PORTAL_UID_MIN}..{PORTAL_UID_MAX}) is not a "
        "usable UID range: the minimum must not exceed the maximum, which must be below 2³¹−1."
    )
from portal.idranges import check_uid_range  # noqa: E402

check_uid_range(PORTAL_UID_MIN, PORTAL_UID_MAX)
# The public half of the portal's own administration key, so nobody can upload it as a
# personal key. When empty, the portal looks for PORTAL_ADMIN_SSH_KEY_FILE + ".pub".
PORTAL_ADMIN_SSH_PUBLIC_KEY = env.string("PORTAL_ADMIN_SSH_PUBLIC_KEY", "")

# --- Workdir snapshots (tpus/services/snapshots.py) -----------------------------------
# A job may carry its code: the files of a workdir, stored once per person by content
# (sha256) and placed on every worker of whichever VM the job lands on. Stored through
# Django's storage API under the name ``snapshots``: a folder of the portal's by default
# (made 0700, files 0600), or a bucket in production (django-storages): set
# PORTAL_SNAPSHOT_STORAGE to gcs (PORTAL_SNAPSHOT_BUCKET, credentials as google-auth
# finds them) or s3 (PORTAL_SNAPSHOT_BUCKET, boto3's credentials chain).
PORTAL_SNAPSHOT_ROOT = Path(env.string("PORTAL_SNAPSHOT_ROOT", str(VAR_DIR / "snapshots")))
PORTAL_SNAPSHOT_STORAGE = env.string("PORTAL_SNAPSHOT_STORAGE", "file")
PORTAL_SNAPSHOT_BUCKET = env.string("PORTAL_SNAPSHOT_BUCKET", "")
if PORTAL_SNAPSHOT_STORAGE == "file":
    SNAPSHOT_STORAGE = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {
            "location": str(PORTAL_SNAPSHOT_ROOT),
            "file_permissions_mode": 0o600,
            "directory_permissions_mode": 0o700,
        },
    }
elif PORTAL_SNAPSHOT_STORAGE in ("gcs", "s3"):
    if not PORTAL_SNAPSHOT_BUCKET:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            f"PORTAL_SNAPSHOT_STORAGE={PORTAL_SNAPSHOT_STORAGE} needs PORTAL_SNAPSHOT_BUCKET."
        )
    SNAPSHOT_STORAGE = {
        "BACKEND": {
            "gcs": "storages.backends.gcloud.GoogleCloudStorage",
            "s3": "storages.backends.s3.S3Storage",
        }[PORTAL_SNAPSHOT_STORAGE],
        # Private objects, never overwritten in place (a blob's name is its content).
        "OPTIONS": {
            "bucket_name": PORTAL_SNAPSHOT_BUCKET,
            "default_acl": "projectPrivate" if PORTAL_SNAPSHOT_STORAGE == "gcs" else "private",
            "file_overwrite": False,
            "querystring_auth": True,
        },
    }
else:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        f"PORTAL_SNAPSHOT_STORAGE is file, gcs or s3, not {PORTAL_SNAPSHOT_STORAGE!r}."
    )
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "snapshots": SNAPSHOT_STORAGE,
}
# What one person may keep stored across all their snapshots (every lab), in MB; a
# lab's own cap on one snapshot is a lab setting.
PORTAL_SNAPSHOT_PERSON_MAX_MB = env.integer("PORTAL_SNAPSHOT_PERSON_MAX_MB", 10240, minimum=1)
# A snapshot no job needs is removed this many days after a job last needed it; a blob
# no snapshot of its owner names, once it is this many hours old (so the blobs of a
# snapshot being uploaded stay until the snapshot is made).
PORTAL_SNAPSHOT_KEEP_DAYS = env.integer("PORTAL_SNAPSHOT_KEEP_DAYS", 7, minimum=1)
PORTAL_SNAPSHOT_BLOB_GRACE_HOURS = env.integer("PORTAL_SNAPSHOT_BLOB_GRACE_HOURS", 24, minimum=1)
PORTAL_SNAPSHOT_EXPIRY_SECONDS = env.integer("PORTAL_SNAPSHOT_EXPIRY_SECONDS", 3600, minimum=10)

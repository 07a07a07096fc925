"""The test suite. ``PORTAL_TEST_BACKEND`` picks the pair of real services a run uses:
``embedded`` (SQLite + the SQLite broker + a file cache) or ``services``
(PostgreSQL + Redis for broker and cache). ``bin/test`` runs both."""

import os
import tempfile
from pathlib import Path

from portal import env
from portal.settings.base import *  # noqa: F403
from portal.settings.base import PORTAL_SNAPSHOT_STORAGE, SNAPSHOT_STORAGE

DEBUG = False
SECRET_KEY = "test-only-key-not-secret-" + "x" * 40
# A fixed Fernet key: test processes and the workers they start must agree on it.
PORTAL_SECRETS_KEY = "dGVzdC1vbmx5LXNlY3JldHMta2V5LW5vdC1zZWNyZXQ="
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
PORTAL_REQUIRE_ADMIN_MFA = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

# Each xdist worker gets its own cache namespace and scratch directory.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
# A worker or beat started by a test inherits its parent's directory (file cache, broker).
VAR_DIR = Path(
    env.string(
        "PORTAL_TEST_VAR_DIR",
        str(Path(tempfile.gettempdir()) / f"tpu-portal-test-{os.getpid()}-{_WORKER}"),
    )
)
VAR_DIR.mkdir(parents=True, exist_ok=True)

TEST_BACKEND = env.string("PORTAL_TEST_BACKEND", "embedded")
if TEST_BACKEND == "services":
    DATABASES = {
        "default": env.database(
            env.string("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tpu_portal")
        )
    }
    # A test database is thrown away: its commits need not wait for the disk.
    DATABASES["default"].setdefault("OPTIONS", {})["options"] = "-c synchronous_commit=off"
    _REDIS = env.string("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": _REDIS,
            # Unique per test process (and shared with the workers it starts), so
            # parallel runs never see or clear each other's keys.
            "KEY_PREFIX": VAR_DIR.name,
        }
    }
    CELERY_BROKER_URL = _REDIS
elif TEST_BACKEND == "embedded":
    DATABASES = {"default": env.database(f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
    # A file, not memory: end-to-end tests share it with a real Celery worker process.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-db.sqlite3")}
    # A test database is thrown away: its commits need not wait for the disk.
    DATABASES["default"]["OPTIONS"]["init_command"] += " PRAGMA synchronous=OFF;"
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(VAR_DIR / "cache"),
        }
    }
    CELERY_BROKER_URL = f"sqla+sqlite:///{VAR_DIR / 'celery-broker.sqlite3'}"
else:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("PORTAL_TEST_BACKEND must be 'embedded' or 'services'.")

# A Celery worker started by an end-to-end test uses the test database and broker of
# the pytest process that started it.
if _name := env.string("PORTAL_TEST_DATABASE_NAME", ""):
    DATABASES["default"]["NAME"] = _name
CELERY_BROKER_URL = env.string("PORTAL_TEST_BROKER_URL", CELERY_BROKER_URL)
# Parallel test processes share Redis; each has its own queue.
CELERY_TASK_DEFAULT_QUEUE = f"portal-test-{_WORKER}"
globals().update(env.email(env.string("PORTAL_TEST_EMAIL_URL", "locmem:")))

# Unit tests run tasks inline; end-to-end tests start a real worker on the broker.
CELERY_TASK_ALWAYS_EAGER = env.boolean("CELERY_TASK_ALWAYS_EAGER", True)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
STATIC_ROOT = VAR_DIR / "static"
PORTAL_SNAPSHOT_ROOT = VAR_DIR / "snapshots"
if PORTAL_SNAPSHOT_STORAGE == "file":
    SNAPSHOT_STORAGE["OPTIONS"]["location"] = str(PORTAL_SNAPSHOT_ROOT)
STATIC_ROOT.mkdir(exist_ok=True)

# Tests never reach Google: unless a test starts the emulator, the Cloud TPU API is a
# closed local port and every call fails fast as UNAVAILABLE. A worker started by an
# end-to-end test is pointed at that test's emulator.
TPU_API_ENDPOINT = env.string("PORTAL_TEST_TPU_API_ENDPOINT", "127.0.0.1:9")
TPU_API_INSECURE = True
TPU_API_CREDENTIALS_FILE = ""

# SSH only to loopback and the test fleet's own network namespaces, never elsewhere
# (emulated TPU VMs have made-up public addresses).
PORTAL_REMOTE_ALLOWED_NETWORKS = [
    "127.0.0.0/8",
    os.environ.get("TESTFLEET_NETWORK", "10.213.0.0/16"),
]

# The fleet's hosts have fake chips and the CPU build of JAX, not libtpu; small floors
# and a short grace keep job tests quick.
PORTAL_JOB_REQUIRE_LIBTPU = env.boolean("PORTAL_JOB_REQUIRE_LIBTPU", False)
PORTAL_JOB_MIN_DISK_MB = env.integer("PORTAL_JOB_MIN_DISK_MB", 10, minimum=0)
PORTAL_JOB_MIN_MEM_MB = env.integer("PORTAL_JOB_MIN_MEM_MB", 10, minimum=0)
PORTAL_JOB_CANCEL_GRACE_SECONDS = env.integer("PORTAL_JOB_CANCEL_GRACE_SECONDS", 2, minimum=0)

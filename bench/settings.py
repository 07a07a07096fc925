"""Settings for the benchmarks: the test settings on PostgreSQL and Redis
(``PORTAL_TEST_BACKEND=services``), pointed at the emulator, the fleet and a queue of
the benchmark's own. The benchmark sets every variable below for itself and for the
Celery worker and beat it starts."""

import os

os.environ.setdefault("PORTAL_TEST_BACKEND", "services")

from portal import env
from portal.settings.test import *  # noqa: F403
from portal.settings.test import (
    CELERY_TASK_DEFAULT_QUEUE,
    PORTAL_REMOTE_ALLOWED_NETWORKS,
    TPU_API_ENDPOINT,
)

# The test settings pin the API to a closed port; the benchmark's emulator is elsewhere.
TPU_API_ENDPOINT = env.string("BENCH_TPU_API_ENDPOINT", TPU_API_ENDPOINT)
# Only the fleet this run created (and loopback).
PORTAL_REMOTE_ALLOWED_NETWORKS = env.listing(
    "BENCH_REMOTE_ALLOWED_NETWORKS", PORTAL_REMOTE_ALLOWED_NETWORKS
)
# A queue no test run shares.
CELERY_TASK_DEFAULT_QUEUE = env.string("BENCH_QUEUE", CELERY_TASK_DEFAULT_QUEUE)

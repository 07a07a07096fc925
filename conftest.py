"""Fixtures every app's tests share: users, labs, a cast of people in each role, and
the Cloud TPU API emulator (the journeys use it too). App-specific fixtures live in
the app's own conftest.py."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
from django.core.cache import cache

pytest_plugins = ["tests.e2e", "testfleet.fixtures"]

# gRPC's core logs each connection the emulator closes at a test's end ("Got goaway")
# at INFO; its errors still show.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

_counter = itertools.count(1)


def _clear_cache() -> None:
    """Empty this test process's part of the cache. On Redis, ``cache.clear()`` would
    flush the whole database under other processes' feet, so delete by prefix."""
    from django.conf import settings

    config = settings.CACHES["default"]
    if config["BACKEND"].endswith("RedisCache"):
        client = cache._cache.get_client(write=True)
        keys = list(client.scan_iter(match=f"{config['KEY_PREFIX']}:*", count=1000))
        if keys:
            client.delete(*keys)
    else:
        cache.clear()


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Rate limits count in the cache; each test starts from zero."""
    _clear_cache()
    yield
    _clear_cache()


@pytest.fixture(autouse=True)
def _no_kept_ssh_connections():
    """The fleet's hosts and their keys outlive a test: each test starts with no SSH
    connection kept open from another (``tpus.remote.kept``)."""
    from tpus.remote.kept import kept

    kept.clear()
    yield
    kept.clear()


@pytest.fixture(autouse=True)
def _outbox_first_attempts_unpaused(monkeypatch):
    """A failed first delivery attempt pauses the next ones in its process for a sweep
    interval (``portal.outbox``); each test starts with them tried at once."""
    from portal import outbox

    monkeypatch.setattr(outbox, "_first_attempts_paused_until", 0.0)


@pytest.fixture
def tpu_emulator(tmp_path, settings):
    """A Cloud TPU API emulator on a free 127.0.0.1 port with an empty lab.

    Yields a ``RunningEmulator``: ``.controls`` sets the scene (``add_node``,
    ``maintenance``, ``fail``...), ``.client`` is a portal ``CloudTPU`` with fast
    retries and polling, and the portal's settings point at it, so ``cloud_tpu()``
    in the code under test talks to it too.
    """
    from tpus.cloud.config import _client_for
    from tpus.emulator.testing import start_emulator

    emulator = start_emulator(tmp_path / "tpu-emulator.json")
    # The portal keeps one client per configuration; an earlier test's emulator may
    # have had this port, and its client's channel would still be backing off from
    # that emulator's going away ("connection refused"). Start from a fresh one.
    _client_for.cache_clear()
    settings.TPU_API_ENDPOINT = emulator.endpoint
    settings.TPU_API_INSECURE = True
    settings.TPU_API_CREDENTIALS_FILE = ""
    try:
        yield emulator
    finally:
        emulator.stop()


class QueuedTasks:
    """What the portal hands to Celery, recorded at ``tpus.queue``'s one door instead
    of sent, so a test runs each task itself, when it is due."""

    def __init__(self):
        self.tasks: list[tuple[str, tuple, float | None]] = []

    def record(self, name: str, *args, countdown: float | None = None) -> None:
        self.tasks.append((name, args, countdown))

    def take(self, name: str) -> list[tuple[tuple, float | None]]:
        """The ``(args, countdown)`` of each task named ``name`` queued since the last
        take; every recorded task is forgotten."""
        found = [(args, countdown) for n, args, countdown in self.tasks if n == name]
        self.tasks.clear()
        return found


@pytest.fixture
def queued_tasks(monkeypatch) -> QueuedTasks:
    """Tasks are recorded, not run (nor sent to a broker): see ``QueuedTasks``."""
    from tpus import queue

    recorder = QueuedTasks()
    monkeypatch.setattr(queue, "_send", recorder.record)
    return recorder


@pytest.fixture
def make_user(db):
    """A user with a verified email address, ready to sign in."""
    from allauth.account.models import EmailAddress

    from accounts.models import User

    def make(email: str | None = None, password: str = "correct horse battery", **fields):
        email = email or f"user{next(_counter)}@example.org"
        user = User.objects.create_user(email=email, password=password, **fields)
        EmailAddress.objects.create(user=user, email=email, verified=True, primary=True)
        return user

    return make


@pytest.fixture
def make_lab(db):
    from tpus.models import Lab

    def make(name: str | None = None, **fields):
        n = next(_counter)
        name = name or f"Lab {n}"
        fields.setdefault("slug", f"lab-{n}")
        fields.setdefault("gcp_project_id", f"lab-project-{n}")
        fields.setdefault("zones", ["us-central1-f"])
        return Lab.objects.create(name=name, **fields)

    return make


@pytest.fixture
def add_member(db):
    """Put a user in a lab directly, in the given state and role."""
    from django.utils import timezone

    from tpus.models import Membership

    def add(lab, user, *, role="member", state="approved"):
        return Membership.objects.create(
            lab=lab,
            user=user,
            role=role,
            state=state,
            policy_version_accepted=lab.policy_version,
            policy_accepted_at=timezone.now(),
        )

    return add


@dataclass
class Cast:
    lab: object
    other_lab: object
    admin: object
    member: object
    pending: object
    outsider: object  # a member of another lab only
    site_admin: object
    pending_membership: object
    member_membership: object
    other_membership: object  # a request in the other lab


@pytest.fixture
def cast(make_user, make_lab, add_member) -> Cast:
    lab = make_lab("Vision Lab", slug="vision", discoverable=False)
    other = make_lab("Other Lab", slug="other", discoverable=False)
    admin, member, pending, outsider = (
        make_user("admin@vision.example"),
        make_user("milo@vision.example"),
        make_user("pat@vision.example"),
        make_user("eve@other.example"),
    )
    site_admin = make_user("root@portal.example", is_superuser=True, is_staff=True)
    add_member(lab, admin, role="admin")
    member_membership = add_member(lab, member)
    pending_membership = add_member(lab, pending, state="requested")
    add_member(other, outsider, role="admin")
    other_membership = add_member(other, make_user("someone@other.example"), state="requested")
    return Cast(
        lab=lab,
        other_lab=other,
        admin=admin,
        member=member,
        pending=pending,
        outsider=outsider,
        site_admin=site_admin,
        pending_membership=pending_membership,
        member_membership=member_membership,
        other_membership=other_membership,
    )


# What makes a test depend on the database and broker it runs on. bin/test runs the
# suite in two passes and every test in at least one:
# - ``--embedded-pass`` (SQLite + the embedded broker): everything but the slow
#   journeys that use the database, which run in the other pass on the services a
#   deployment uses; those marked ``quickstart`` (the embedded stack's own journeys:
#   bin/demo, a real beat and worker) run here too;
# - ``--backend-bound`` (PostgreSQL + Redis): only the tests that use the database or
#   the broker; one with neither (a script on the fleet, a parser, the emulator) would
#   do the same work again and prove nothing new. bin/demo's own journeys (marked
#   ``demo``) are left out too: bin/demo runs on SQLite + the embedded broker only, and
#   the other journeys walk the same pages on these services.
BACKEND_FIXTURES = {
    "db",
    "transactional_db",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
    "live_server",
    "celery_worker_process",
}


def pytest_addoption(parser):
    parser.addoption(
        "--embedded-pass",
        action="store_true",
        help="bin/test's first pass: leave out the slow journeys that use the database "
        "(they run in the PostgreSQL + Redis pass), except those marked quickstart",
    )
    parser.addoption(
        "--backend-bound",
        action="store_true",
        help="run only the tests that use the database or the broker (bin/test's second "
        "pass, on the other backend: the rest ran in the first)",
    )


def backend_bound(item) -> bool:
    return bool(BACKEND_FIXTURES.intersection(getattr(item, "fixturenames", ()))) or (
        item.get_closest_marker("django_db") is not None
    )


def elsewhere_in_the_first_pass(item) -> bool:
    """A slow journey on the database, run in the PostgreSQL + Redis pass only."""
    return (
        item.get_closest_marker("slow") is not None
        and item.get_closest_marker("quickstart") is None
        and backend_bound(item)
    )


def in_the_second_pass(item) -> bool:
    return backend_bound(item) and item.get_closest_marker("demo") is None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--backend-bound"):
        keep = in_the_second_pass
    elif config.getoption("--embedded-pass"):
        keep = lambda item: not elsewhere_in_the_first_pass(item)  # noqa: E731
    else:
        return
    kept, dropped = [], []
    for item in items:
        (kept if keep(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_sessionfinish(session):
    """Remove this test process's scratch directory (database, broker, cache)."""
    import os
    import shutil

    from django.conf import settings

    if "PORTAL_TEST_VAR_DIR" not in os.environ and "tpu-portal-test-" in str(settings.VAR_DIR):
        shutil.rmtree(settings.VAR_DIR, ignore_errors=True)

"""Fixtures every app's tests share. App-specific fixtures live in the app's own
conftest.py."""

from __future__ import annotations

import itertools

import pytest
from django.core.cache import cache

pytest_plugins = ["testfleet.fixtures"]

_counter = itertools.count(1)


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Rate limits count in the cache; each test starts from zero."""
    cache.clear()
    yield
    cache.clear()


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

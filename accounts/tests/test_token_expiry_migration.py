"""Upgrading to expiring tokens: every token made before gets the site's lifetime from
the upgrade on, so nobody is signed out by it and no token lives forever."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone


def _targets():
    """The migration that gives tokens an end, and the state just before it (found by
    name, so renumbering does not break this test)."""
    graph = MigrationExecutor(connection).loader.graph
    key = next(k for k in graph.nodes if k[0] == "accounts" and k[1].endswith("_api_token_expiry"))
    (before,) = [p.key for p in graph.node_map[key].parents if p.key[0] == "accounts"]
    return [before], [key]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_tokens_made_before_the_upgrade_get_the_sites_lifetime_from_then(settings):
    settings.PORTAL_TOKEN_LIFETIME_DAYS = 30
    before, after = _targets()
    old = _migrate(before)
    user = old.get_model("accounts", "User").objects.create(email="milo@uni.example")
    made = timezone.now() - dt.timedelta(days=400)
    old.get_model("accounts", "ApiToken").objects.create(
        user=user, name="old laptop", hint="tpp_abcdef", digest="d" * 64, created_at=made
    )
    try:
        new = _migrate(after)
        token = new.get_model("accounts", "ApiToken").objects.get()
        left = token.expires_at - timezone.now()
        assert dt.timedelta(days=29, hours=23) < left <= dt.timedelta(days=30)
    finally:
        latest = _migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
        latest.get_model("accounts", "User").objects.all().delete()

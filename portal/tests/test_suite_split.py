"""bin/test runs the whole suite on one backend and, on the other, only what uses the
database or the broker (``--backend-bound``): what decides that for a test."""

from __future__ import annotations

import pytest

from conftest import backend_bound


def test_a_test_with_no_database_runs_in_one_pass_only(request):
    assert not backend_bound(request.node)


def test_a_test_that_uses_the_database_runs_on_both(request, db):
    assert backend_bound(request.node)


@pytest.mark.django_db
def test_a_test_marked_for_the_database_runs_on_both(request):
    assert backend_bound(request.node)


def test_a_test_with_a_live_server_runs_on_both(request, live_server):
    assert backend_bound(request.node)

"""bin/test runs every test in at least one of its two passes: on SQLite + the
embedded broker all but the slow journeys on the database (``--embedded-pass``, the
quick start's own journeys kept), on PostgreSQL + Redis only what uses the database or
the broker (``--backend-bound``), bin/demo's journeys left out (it runs on SQLite +
the embedded broker only). What decides that for a test."""

from __future__ import annotations

import pytest

from conftest import backend_bound, elsewhere_in_the_first_pass, in_the_second_pass


def test_a_test_with_no_database_runs_in_one_pass_only(request):
    assert not backend_bound(request.node)


def test_a_test_that_uses_the_database_runs_on_both(request, db):
    assert backend_bound(request.node)


@pytest.mark.django_db
def test_a_test_marked_for_the_database_runs_on_both(request):
    assert backend_bound(request.node)


def test_a_test_with_a_live_server_runs_on_both(request, live_server):
    assert backend_bound(request.node)


@pytest.mark.slow
def test_a_slow_journey_on_the_database_runs_on_the_services_only(request, db):
    assert backend_bound(request.node) and elsewhere_in_the_first_pass(request.node)


@pytest.mark.slow
@pytest.mark.quickstart
def test_a_journey_of_the_quick_starts_stack_runs_on_both(request, db):
    assert backend_bound(request.node) and not elsewhere_in_the_first_pass(request.node)


@pytest.mark.slow
def test_a_slow_test_with_no_database_runs_in_the_first_pass(request):
    assert not backend_bound(request.node) and not elsewhere_in_the_first_pass(request.node)


@pytest.mark.slow
@pytest.mark.quickstart
@pytest.mark.demo
def test_a_journey_of_bin_demo_runs_on_its_own_stack_only(request, live_server):
    assert not elsewhere_in_the_first_pass(request.node)
    assert backend_bound(request.node) and not in_the_second_pass(request.node)


def test_what_uses_the_database_runs_in_the_second_pass(request, db):
    assert in_the_second_pass(request.node)

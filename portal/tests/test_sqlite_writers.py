"""On the embedded database, a transaction that reads and then writes waits for
another process's write instead of failing with "database is locked" (the web page
queueing a job while the worker's job pass writes, for one)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction

from tpus.models import Lab


@pytest.mark.django_db(transaction=True)
def test_a_read_then_write_transaction_waits_for_the_other_writer(make_lab):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's locking; PostgreSQL locks rows")
    lab = make_lab("Vision", slug="vision")
    reading, written = threading.Event(), threading.Event()

    def other_writer():
        try:
            reading.wait(5)
            Lab.objects.filter(pk=lab.pk).update(name="Vision (renamed)")
            written.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_writer)
    thread.start()
    try:
        with transaction.atomic():
            assert Lab.objects.get(pk=lab.pk).slug == "vision"  # read first
            reading.set()
            written.wait(1)  # the other write happens meanwhile, or waits for us
            Lab.objects.filter(pk=lab.pk).update(policy_text="Be kind.")  # then write
    finally:
        thread.join(10)
    lab.refresh_from_db()
    assert (lab.name, lab.policy_text) == ("Vision (renamed)", "Be kind.")

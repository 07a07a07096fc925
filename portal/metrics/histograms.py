"""Durations the portal measures as it works, kept in the database as histograms.

Celery's prefork workers and gunicorn's processes each live and die on their own, and
a worker may run on another machine than the web process that serves ``/metrics``; an
in-memory histogram would be per process and lost on every restart. So each
observation is one upsert of a ``HistogramBucket`` row (its bucket's count and the
series' sum), and ``/metrics`` reads the rows whole: the figures are cumulative across
every process and every restart, as Prometheus counters should be.

A histogram's bounds are part of its stored rows (the row keeps the bucket's index):
changing them needs a new metric name.
"""

from __future__ import annotations

import json
import logging
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from django.db import connection, transaction
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from portal.models import HistogramBucket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Histogram:
    help: str
    labels: tuple[str, ...]
    bounds: tuple[float, ...]


TASK_DURATION = "portal_task_duration_seconds"
RECONCILE_DURATION = "portal_reconcile_duration_seconds"
REVOKE_DURATION = "portal_revoke_duration_seconds"

HISTOGRAMS: dict[str, Histogram] = {
    TASK_DURATION: Histogram(
        "Celery tasks run by the workers, by task and outcome (succeeded, failed, "
        "retried), and how long each ran.",
        ("task", "outcome"),
        (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
    ),
    RECONCILE_DURATION: Histogram(
        "Reconciles of a TPU VM's workers, from the claim to the last run's end, by "
        "outcome (complete: every worker applied the state; incomplete: some worker "
        "failed or is tried again; taken_over: a revoke took the VM over; error).",
        ("outcome",),
        (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
    ),
    REVOKE_DURATION: Histogram(
        "Revokes, from the admin's click (or the expiry) to every worker having applied it.",
        (),
        (0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 86400),
    ),
}

_UPSERT = (
    "INSERT INTO {table} (name, labels, bucket, samples, seconds) VALUES (%s, %s, %s, 1, %s) "
    "ON CONFLICT (name, labels, bucket) DO UPDATE SET "
    "samples = {table}.samples + 1, seconds = {table}.seconds + excluded.seconds"
)


def observe(name: str, seconds: float, **labels: str) -> None:
    """Add one observation. Never raises: a measurement lost to a database error must
    not fail the work it measured (a warning is logged). Inside a transaction it
    commits with it; it is its own savepoint, so a failure leaves the transaction
    usable."""
    spec = HISTOGRAMS[name]
    seconds = max(0.0, float(seconds))
    key = json.dumps([str(labels[label]) for label in spec.labels])
    bucket = bisect_left(spec.bounds, seconds)
    table = connection.ops.quote_name(HistogramBucket._meta.db_table)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_UPSERT.format(table=table), [name, key, bucket, seconds])
    except Exception:
        log.warning("could not record %s=%.3f %s", name, seconds, labels, exc_info=True)


def families() -> Iterator[HistogramMetricFamily]:
    """Every histogram with the rows stored so far: one query."""
    rows: dict[str, dict[str, list]] = defaultdict(dict)
    for name, key, bucket, samples, seconds in HistogramBucket.objects.values_list(
        "name", "labels", "bucket", "samples", "seconds"
    ):
        spec = HISTOGRAMS.get(name)
        if spec is None or bucket > len(spec.bounds):
            continue  # a histogram this version no longer has
        counts, total = rows[name].setdefault(key, [[0] * (len(spec.bounds) + 1), 0.0])
        counts[bucket] += samples
        rows[name][key][1] = total + seconds
    for name, spec in HISTOGRAMS.items():
        family = HistogramMetricFamily(name, spec.help, labels=list(spec.labels))
        series = rows.get(name, {})
        if not spec.labels and not series:
            series = {"[]": [[0] * (len(spec.bounds) + 1), 0.0]}  # always one series
        for key, (counts, total) in sorted(series.items()):
            family.add_metric(json.loads(key), _cumulative(spec.bounds, counts), total)
        yield family


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    running, buckets = 0, []
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        running += count
        buckets.append((floatToGoString(bound), running))
    return buckets

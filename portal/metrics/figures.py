"""The figures ``/metrics`` reads when it is scraped: the broker's queues and the rows
that say how the portal's work stands. Nothing here is kept in a process, so every
gunicorn process answers the same, and a constant number of queries answers however
many labs, jobs or grants there are. Labs are named by slug; no person appears."""

from __future__ import annotations

from collections.abc import Iterator

from django.conf import settings
from django.db.models import Count, Min
from django.utils import timezone
from kombu import Connection
from kombu.exceptions import ChannelError
from prometheus_client.core import GaugeMetricFamily

from portal.celery import app as celery_app
from portal.models import OutboxMessage, OutboxState
from tpus.models import Grant, Job, Lab, ZoneSync
from tpus.models.grants import GrantState
from tpus.models.jobs import WAITING_STATES, JobState

BROKER_TIMEOUT = 3.0


def families() -> Iterator[GaugeMetricFamily]:
    yield from _broker()
    yield from _outbox()
    yield from _labs()
    yield _by_state(
        "portal_jobs", "Jobs in each state, every lab's together.", Job, JobState.values
    )
    yield _by_state(
        "portal_grants",
        "Grants (a person's access to a TPU VM) in each state.",
        Grant,
        GrantState.values,
    )


def queue_names() -> list[str]:
    """The queues the workers consume: the default one and any declared."""
    conf = celery_app.conf
    names = [conf.task_default_queue]
    names += [queue.name for queue in conf.task_queues or ()]
    return list(dict.fromkeys(names))


def _broker() -> Iterator[GaugeMetricFamily]:
    up = GaugeMetricFamily("portal_broker_up", "1 when the Celery broker answered the scrape.")
    depth = GaugeMetricFamily(
        "portal_celery_queue_depth",
        "Messages waiting in the broker for a worker (not those a worker has taken).",
        labels=["queue"],
    )
    try:
        with Connection(settings.CELERY_BROKER_URL, connect_timeout=BROKER_TIMEOUT) as conn:
            conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)
            channel = conn.default_channel
            for name in queue_names():
                depth.add_metric([name], _waiting(channel, name))
        up.add_metric([], 1)
    except Exception:
        up.add_metric([], 0)
        depth.samples.clear()  # a half-read broker says nothing
    yield up
    yield depth


def _waiting(channel, name: str) -> int:
    try:
        return channel.queue_declare(queue=name, passive=True).message_count
    except ChannelError:  # Redis has no key for an empty queue
        return 0


def _outbox() -> Iterator[GaugeMetricFamily]:
    rows = {
        row["state"]: row
        for row in OutboxMessage.objects.filter(state__in=(OutboxState.PENDING, OutboxState.FAILED))
        .values("state")
        .annotate(count=Count("id"), oldest=Min("created_at"))
        .order_by()
    }
    messages = GaugeMetricFamily(
        "portal_outbox_messages",
        "Emails in the outbox not delivered: waiting (being tried) or failed (given up).",
        labels=["state"],
    )
    for label, state in (("waiting", OutboxState.PENDING), ("failed", OutboxState.FAILED)):
        messages.add_metric([label], rows.get(state, {}).get("count", 0))
    yield messages
    oldest = rows.get(OutboxState.PENDING, {}).get("oldest")
    yield GaugeMetricFamily(
        "portal_outbox_oldest_waiting_seconds",
        "How long the oldest email still being tried has waited (0 when none waits).",
        value=_age(oldest),
    )


def _labs() -> Iterator[GaugeMetricFamily]:
    now = timezone.now()
    labs = list(Lab.objects.order_by("slug").values_list("id", "slug", "zones"))
    listed: dict[tuple[int, str], object] = {}
    failing: dict[tuple[int, str], bool] = {}
    for lab_id, zone, success, since in ZoneSync.objects.values_list(
        "lab_id", "zone", "last_success_at", "failing_since"
    ):
        listed[(lab_id, zone)] = success
        failing[(lab_id, zone)] = since is not None
    waiting = {
        row["vm__lab_id"]: row
        for row in Job.objects.filter(state__in=WAITING_STATES)
        .values("vm__lab_id")
        .annotate(count=Count("id"), oldest=Min("queued_at"))
        .order_by()
    }
    age = GaugeMetricFamily(
        "portal_lab_sync_age_seconds",
        "Since the lab's least recently listed zone was last listed from the Cloud TPU "
        "API (+Inf: a zone never listed yet). Labs without zones have none.",
        labels=["lab"],
    )
    zones_failing = GaugeMetricFamily(
        "portal_lab_sync_failing_zones",
        "The lab's zones whose last listing failed.",
        labels=["lab"],
    )
    queued = GaugeMetricFamily(
        "portal_queued_jobs",
        "Jobs of the lab waiting for their TPU VM (queued or blocked).",
        labels=["lab"],
    )
    oldest = GaugeMetricFamily(
        "portal_queued_job_oldest_wait_seconds",
        "How long the lab's longest-waiting job has waited for its TPU VM (0: none waits).",
        labels=["lab"],
    )
    for lab_id, slug, zones in labs:
        if zones:
            times = [listed.get((lab_id, zone)) for zone in zones]
            age.add_metric(
                [slug],
                float("inf")
                if any(t is None for t in times)
                else (now - min(times)).total_seconds(),
            )
            zones_failing.add_metric([slug], sum(failing.get((lab_id, z), False) for z in zones))
        row = waiting.get(lab_id, {})
        queued.add_metric([slug], row.get("count", 0))
        oldest.add_metric([slug], _age(row.get("oldest"), now))
    yield from (age, zones_failing, queued, oldest)


def _by_state(name: str, help_text: str, model, states: list[str]) -> GaugeMetricFamily:
    counts = dict(model.objects.values_list("state").annotate(count=Count("id")).order_by())
    family = GaugeMetricFamily(name, help_text, labels=["state"])
    for state in states:
        family.add_metric([state], counts.get(state, 0))
    return family


def _age(when, now=None) -> float:
    if when is None:
        return 0.0
    return max(0.0, ((now or timezone.now()) - when).total_seconds())

"""The Celery application. Settings come from Django's (``CELERY_*``); tasks are
discovered in each app's ``tasks`` module."""

import os

from celery import Celery
from celery.signals import beat_init
from kombu.transport import TRANSPORT_ALIASES

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.local")

# The embedded SQLite broker, with options kombu would otherwise hand to SQLAlchemy.
TRANSPORT_ALIASES["sqla"] = "portal.broker:Transport"

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def every(seconds: float, name: str | None = None):
    """Declare a periodic task next to its function: ``@every(60)`` above ``@shared_task``.
    Celery beat (exactly one) reads the schedule after the task modules are imported."""

    def register(task):
        key = name or task.name
        app.conf.beat_schedule = {
            **(app.conf.beat_schedule or {}),
            key: {"task": task.name, "schedule": float(seconds)},
        }
        return task

    return register


@beat_init.connect
def _beat_started(**_) -> None:
    """Beat records its start: until its first heartbeat is due, the dashboard and
    /healthz say the background work is starting, not that it is not running."""
    from portal import heartbeat

    heartbeat.record_beat_started()

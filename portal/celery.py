"""The Celery application. Settings come from Django's (``CELERY_*``); tasks are
discovered in each app's ``tasks`` module."""

import os

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings.local")

# The embedded SQLite broker, with options kombu would otherwise hand to SQLAlchemy.
TRANSPORT_ALIASES["sqla"] = "portal.broker:Transport"

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

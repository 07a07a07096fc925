"""Logging filters for secrets that travel in URLs.

The ssh-config refresh URL carries a token that works like a password
(``/ssh/feed/<token>/config``). Request logs (``django.server``, ``django.request``)
show the path with the token replaced, so log files and log shippers never hold it.
"""

from __future__ import annotations

import logging
import re

# The token is the path segment between /ssh/feed/ and the file name.
FEED_TOKEN = re.compile(r"(/ssh/feed/)[^/\s\"'?#]+(?=/(?:config|known_hosts)\b)")
REDACTED = "[redacted]"


def redact(text: str) -> str:
    return FEED_TOKEN.sub(r"\1" + REDACTED, text)


class RedactFeedTokens(logging.Filter):
    """Rewrites a record whose message holds a refresh-URL token; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


class QuietPermissionDenied(logging.Filter):
    """An ordinary 403 (a person asked for something they may not do) is logged as one
    line, without the traceback Django attaches: it is not a fault of the portal."""

    def filter(self, record: logging.LogRecord) -> bool:
        from django.core.exceptions import PermissionDenied

        if record.exc_info and isinstance(record.exc_info[1], PermissionDenied):
            record.exc_info, record.exc_text = None, None
        return True


class QuietPeriodicTasks(logging.Filter):
    """Drops Celery's routine lines about periodic tasks: beat's "Sending due task
    poll-jobs (…)" and the worker's "Task …poll_jobs[…] received" and "… succeeded",
    which come every few seconds and bury what a person trying the portal looks for
    (the sign-up email on the same console). Warnings and errors always pass. Used
    where PORTAL_LOG_PERIODIC_TASKS is off (local mode): ``quiet_periodic_tasks``."""

    LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace")

    def __init__(self, names: frozenset[str] | None = None):
        super().__init__()
        self._names = names

    def names(self) -> frozenset[str]:
        if self._names is None:
            from portal.celery import app

            schedule = app.conf.beat_schedule or {}
            self._names = frozenset(entry["task"] for entry in schedule.values())
        return self._names

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or record.name not in self.LOGGERS:
            return True
        message = record.getMessage()
        return not any(f"{name}[" in message or f"({name})" in message for name in self.names())


def quiet_periodic_tasks(config: dict) -> dict:
    """A copy of the ``LOGGING`` dict with ``QuietPeriodicTasks`` on Celery's loggers
    that narrate periodic tasks."""
    loggers = dict(config.get("loggers", {}))
    for name in QuietPeriodicTasks.LOGGERS:
        entry = dict(loggers.get(name, {}))
        entry["filters"] = [*entry.get("filters", []), "quiet_periodic_tasks"]
        loggers[name] = entry
    filters = {**config.get("filters", {}), "quiet_periodic_tasks": {"()": QuietPeriodicTasks}}
    return {**config, "filters": filters, "loggers": loggers}

"""The emails as tasks, kept for messages an earlier version queued: the services now
write each email to the outbox in the transaction of the change it tells of, and
nothing queues these. Each reloads its rows, re-checks that the news still holds, and
stores the message in the outbox (``tpus.services.emails``); the claims keep it to one
email however many times it runs."""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

from tpus.services import emails
from tpus.tasks.naming import task

# Mail itself never fails a task (the outbox retries delivery for hours); this covers
# a task that could not read its rows or store its message (the database briefly gone).
RETRY = {
    "autoretry_for": (OSError, InterfaceError, OperationalError),
    "retry_backoff": 2,
    "retry_backoff_max": 300,
    "retry_jitter": True,
    "max_retries": 6,
}

send_membership_email = task(**RETRY)(emails.send_membership_email)
send_invite_email = task(**RETRY)(emails.send_invite_email)
send_grant_email = task(**RETRY)(emails.send_grant_email)
send_host_key_alert = task(**RETRY)(emails.send_host_key_alert)
send_sync_alert = task(**RETRY)(emails.send_sync_alert)
send_ip_change_email = task(**RETRY)(emails.send_ip_change_email)
send_drift_alert = task(**RETRY)(emails.send_drift_alert)
send_job_email = task(**RETRY)(emails.send_job_email)

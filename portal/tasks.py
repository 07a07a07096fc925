"""The portal's own periodic work: delivering the outbox."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from portal import outbox
from portal.celery import every


@every(settings.PORTAL_MAIL_SWEEP_SECONDS, name="send-mail")
@shared_task(ignore_result=True)
def send_mail() -> None:
    """Send the outbox messages whose retry is due, or whose sender died mid-attempt
    (after a worker restart, everything still pending goes out from here)."""
    outbox.send_due()

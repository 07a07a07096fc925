"""Sending the portal's email: every message is a pair of templates
(``emails/<name>.subject.txt`` and ``emails/<name>.txt``) rendered with a context."""

from __future__ import annotations

from django.conf import settings
from django.core.mail import EmailMessage
from django.template.loader import render_to_string


def send(name: str, to: list[str], context: dict) -> None:
    """Render and send one message. An empty recipient list sends nothing."""
    recipients = sorted({address for address in to if address})
    if not recipients:
        return
    context = {"SITE_URL": settings.SITE_URL, **context}
    subject = render_to_string(f"emails/{name}.subject.txt", context)
    subject = settings.ACCOUNT_EMAIL_SUBJECT_PREFIX + " ".join(subject.split())
    body = render_to_string(f"emails/{name}.txt", context)
    EmailMessage(subject=subject, body=body, to=recipients).send()

"""Sending the portal's email: every message is a pair of templates
(``emails/<name>.subject.txt`` and ``emails/<name>.txt``) rendered with a context and
stored in the outbox (``portal.outbox``), which delivers it and retries until the SMTP
server takes it."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.mail import EmailMessage, EmailMultiAlternatives
from django.template.loader import render_to_string

from portal import outbox


def send(name: str, to: list[str], context: dict) -> None:
    """Render one message and put it in the outbox, in the caller's transaction; it is
    sent once that commits. An empty recipient list sends nothing. Never raises for an
    unreachable or refusing SMTP server."""
    recipients = sorted({address for address in to if address})
    if not recipients:
        return
    outbox.enqueue(name, recipients, *_render(name, context))


def send_later(name: str, to: list[str], args: dict) -> None:
    """Put a message in the outbox, in the caller's transaction, to be rendered at its
    first attempt (right after the commit, or by the sweep) with the context that
    ``register(name, …)``'s function makes of ``args`` then: a change whose email
    needs many reads commits without them, and the email tells what is true when it
    goes out. ``args`` must be JSON (ids, not objects)."""
    recipients = sorted({address for address in to if address})
    if recipients:
        outbox.enqueue(name, recipients, "", "", render_with=name, render_args=args)


def register(name: str, context_of: Callable[[dict], dict | None]) -> None:
    """``context_of(args)``: the context of a ``send_later`` message ``name``, or None
    when what it would say is no longer true (it is then not sent)."""

    def render(args: dict) -> tuple[str, str] | None:
        context = context_of(args)
        return None if context is None else _render(name, context)

    outbox.register_renderer(name, render)


def _render(name: str, context: dict) -> tuple[str, str]:
    context = {"SITE_URL": settings.SITE_URL, **context}
    subject = render_to_string(f"emails/{name}.subject.txt", context)
    subject = settings.ACCOUNT_EMAIL_SUBJECT_PREFIX + " ".join(subject.split())
    return subject, render_to_string(f"emails/{name}.txt", context)


def send_message(kind: str, message: EmailMessage) -> None:
    """Put a message someone else rendered (django-allauth's) in the outbox."""
    html = ""
    if isinstance(message, EmailMultiAlternatives):
        html = next(
            (content for content, mimetype in message.alternatives if mimetype == "text/html"),
            "",
        )
    body = message.body
    if message.content_subtype == "html":
        body, html = "", message.body
    outbox.enqueue(
        kind,
        list(message.to),
        message.subject,
        body,
        html_body=html,
        from_email=message.from_email or "",
    )

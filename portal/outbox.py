"""Delivering the outbox: the one place the portal talks to the SMTP server.

A message is stored by ``enqueue`` in the caller's transaction and tried once as soon
as that transaction commits; if the server refuses or cannot be reached, the periodic
sweep (``send_due``) tries again with exponential backoff until the message is sent or
PORTAL_MAIL_GIVE_UP_SECONDS have passed. Nobody waits for a delivery and nothing here
raises to the caller.

After an outage: the back-off is each message's, but the server's recovery is news for
all of them. Every successful send makes every message waiting out a back-off due at
once, and a sweep with nothing due tries the message due soonest anyway (one attempt
per sweep), so once the server takes mail again everything waiting goes out within
about one sweep interval (PORTAL_MAIL_SWEEP_SECONDS), still once each.

Exactly once: every attempt first claims the row by moving its ``next_attempt_at``
forward with a conditional UPDATE (compare-and-set on the value it read), so two
sweeps, or a sweep and the first attempt, never both send one message. One window is
unavoidable: if the SMTP server accepts a message and the process dies (or loses the
database) before recording it, the row's lease runs out and the message is sent again.
Every attempt carries the same Message-ID, so a mail client can tell it is the same.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import smtplib
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.core.mail.utils import DNS_NAME
from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from portal.models import OutboxMessage, OutboxState

logger = logging.getLogger(__name__)

# How long one attempt may hold a message. Django's SMTP backend times out each socket
# operation after EMAIL_TIMEOUT (15 s), so an attempt ends well within this.
LEASE = dt.timedelta(seconds=120)
# How long a new message is left to the process that wrote it: its first attempt claims
# the row right after the commit (milliseconds), so this only covers a process that
# died (or was stopped) in between; then the sweep sends it.
FIRST_ATTEMPT_LEASE = dt.timedelta(seconds=20)
# The sweep stops early after this many failures in a row: the server is most likely
# down, and the rest are tried at the next sweep instead of each waiting for a timeout.
FAILURES_BEFORE_PAUSE = 3
SWEEP_LIMIT = 200
# The dashboard counts a pending message as waiting once it is this old.
WAITING_AFTER = dt.timedelta(minutes=1)
FAILED_SHOWN_FOR = dt.timedelta(days=7)


def enqueue(
    kind: str,
    to: list[str],
    subject: str,
    body: str,
    *,
    html_body: str = "",
    from_email: str = "",
    render_with: str = "",
    render_args: dict | None = None,
) -> OutboxMessage:
    """Store a message in the current transaction and try to send it once the
    transaction commits (at once outside a transaction). A transaction that rolls back
    takes the message with it, unsent. With ``render_with`` (a name given to
    ``register_renderer``) the subject and body are written at the first attempt, from
    ``render_args``: the change's transaction stores a row and renders nothing."""
    from email.utils import make_msgid

    now = timezone.now()
    message = OutboxMessage.objects.create(
        kind=kind,
        to=",".join(to),
        from_email=from_email,
        subject=subject,
        body=body,
        html_body=html_body,
        render_with=render_with,
        render_args=render_args or {},
        message_id=make_msgid(domain=str(DNS_NAME)),
        created_at=now,
        # The creator's own lease: the sweep leaves the row alone until the first
        # attempt has claimed it, and takes it over if that attempt never happens.
        next_attempt_at=now + FIRST_ATTEMPT_LEASE,
    )
    pk, lease = message.pk, message.next_attempt_at
    transaction.on_commit(lambda: _first_attempt_or_hold(pk, lease))
    return message


# A renderer: what a message says, (subject, body), from its ``render_args``; None
# when what it would say is no longer true (the message is then dropped, unsent).
Renderer = Callable[[dict], "tuple[str, str] | None"]
_renderers: dict[str, Renderer] = {}


def register_renderer(name: str, render: Renderer) -> None:
    """Make ``render`` the renderer of messages stored with ``render_with=name`` (at
    start-up, by the app whose messages they are, in every process)."""
    _renderers[name] = render


def _render(message: OutboxMessage) -> bool:
    """Write a message stored unrendered, from what is true now, and keep the text.
    False when there is nothing true left to say: it is dropped."""
    render = _renderers.get(message.render_with)
    if render is None:
        raise LookupError(f"no renderer is registered for {message.render_with!r}")
    written = render(message.render_args)
    if written is None:
        message.drop(f"Not sent: what {message.kind} would say was no longer true.")
        return False
    message.write(*written)
    return True


_holding = threading.local()


@contextmanager
def first_attempts_held():
    """Within it, the first attempt of each message whose transaction commits there
    waits for the way out: what the caller does next after that commit (a job placed
    on a VM whose grant just went active, its pass queued) does not wait on the SMTP
    server. The message is stored with its change as always; a process that dies
    before the way out leaves it to the sweep, as after any commit."""
    if getattr(_holding, "attempts", None) is not None:
        yield  # an outer one makes them
        return
    _holding.attempts = held = []
    try:
        yield
    finally:
        _holding.attempts = None
        for pk, lease in held:
            _first_attempt(pk, lease)


def _first_attempt_or_hold(pk: int, lease: dt.datetime) -> None:
    held = getattr(_holding, "attempts", None)
    if held is not None:
        held.append((pk, lease))
        return
    _first_attempt(pk, lease)


# After an attempt timed out, this process leaves new messages to the sweep for one
# sweep interval instead of trying each at once: a server that hangs would hold the
# request, reconcile or job pass that wrote them for EMAIL_TIMEOUT per message. (A
# refusal or a closed port answers at once and pauses nothing.)
_first_attempts_paused_until = 0.0


def _first_attempt(pk: int, lease: dt.datetime) -> None:
    if time.monotonic() < _first_attempts_paused_until:
        return  # the sweep sends it once the writer's lease runs out
    try:
        message = _claim(pk, lease)
        if message is not None:
            attempt(message)
    except Exception:
        # Runs after the caller's commit: whatever went wrong, the caller's work stands
        # and the sweep sends the message once the lease runs out.
        logger.exception("first delivery attempt of outbox message %s failed", pk)


def _claim(pk: int, seen_next_attempt_at: dt.datetime) -> OutboxMessage | None:
    """Take the message if nobody else has since it was read: the UPDATE only matches
    while ``next_attempt_at`` still holds the value seen."""
    lease_until = timezone.now() + LEASE
    claimed = OutboxMessage.objects.filter(
        pk=pk, state=OutboxState.PENDING, next_attempt_at=seen_next_attempt_at
    ).update(next_attempt_at=lease_until, attempts=F("attempts") + 1, backing_off=False)
    if claimed != 1:
        return None
    return OutboxMessage.objects.get(pk=pk)


def claim_next_due() -> OutboxMessage | None:
    """Claim the pending message that has been due longest, or None when none is due.
    Losing a race for one row moves on to the next."""
    for _ in range(SWEEP_LIMIT):
        due = (
            OutboxMessage.objects.filter(
                state=OutboxState.PENDING, next_attempt_at__lte=timezone.now()
            )
            .order_by("next_attempt_at", "pk")
            .values_list("pk", "next_attempt_at")
            .first()
        )
        if due is None:
            return None
        message = _claim(*due)
        if message is not None:
            return message
    return None


def claim_soonest_waiting() -> OutboxMessage | None:
    """Claim the message whose back-off ends soonest, though it has not ended: a probe
    of whether the server takes mail again. None when nothing waits (or another sender
    took it first)."""
    waiting = (
        OutboxMessage.objects.filter(state=OutboxState.PENDING, backing_off=True)
        .order_by("next_attempt_at", "pk")
        .values_list("pk", "next_attempt_at")
        .first()
    )
    return _claim(*waiting) if waiting else None


def send_due(limit: int = SWEEP_LIMIT) -> int:
    """Send messages whose retry is due (or whose sender died), one claim at a time so
    each lease starts right before its own attempt; with nothing due, try one message
    still backing off (if the server is back, its success makes the rest due and this
    sweep sends them). Returns how many were sent (or dropped: nothing true left to
    say)."""
    sent = failures_in_a_row = 0
    probed = False
    for _ in range(limit):
        message = claim_next_due()
        if message is None and not (probed or sent or failures_in_a_row):
            probed = True
            message = claim_soonest_waiting()
        if message is None:
            break
        if attempt(message):
            sent += 1
            failures_in_a_row = 0
        else:
            failures_in_a_row += 1
            if failures_in_a_row >= FAILURES_BEFORE_PAUSE:
                break
    return sent


def attempt(message: OutboxMessage) -> bool:
    """Hand a claimed message to the SMTP server (written first, if it was stored
    unrendered) and record what happened. True when it is settled: sent, or dropped
    with nothing true left to say."""
    global _first_attempts_paused_until
    try:
        if message.render_with and not _render(message):
            return True
        _as_email(message).send()
    except Exception as exc:
        # smtplib reports a silent server as "disconnected", caused by the timeout.
        if isinstance(exc, TimeoutError) or isinstance(exc.__context__, TimeoutError):
            _first_attempts_paused_until = time.monotonic() + settings.PORTAL_MAIL_SWEEP_SECONDS
        if not isinstance(exc, smtplib.SMTPException | OSError):
            logger.exception("outbox message %s could not be sent", message.pk)
        _record_failure(message, _describe(exc), permanent=_is_permanent(exc))
        return False
    message.mark_sent(timezone.now())
    _end_back_offs()
    return True


def _end_back_offs() -> int:
    """The server took a message: every message waiting out a back-off is due now (the
    sweep sends them; its claims keep each to one attempt). A row being attempted is
    not touched: a claim clears ``backing_off`` in the same UPDATE that takes it."""
    now = timezone.now()
    return OutboxMessage.objects.filter(
        state=OutboxState.PENDING, backing_off=True, next_attempt_at__gt=now
    ).update(next_attempt_at=now)


def _record_failure(message: OutboxMessage, error: str, *, permanent: bool) -> None:
    now = timezone.now()
    give_up_at = message.created_at + dt.timedelta(seconds=settings.PORTAL_MAIL_GIVE_UP_SECONDS)
    if permanent or now >= give_up_at:
        logger.error("giving up on outbox message %s to %s: %s", message.pk, message.to, error)
        message.mark_failed(error)
        return
    retry_at = min(now + dt.timedelta(seconds=backoff(message.attempts)), give_up_at)
    logger.warning(
        "outbox message %s to %s not sent (attempt %s), retrying at %s: %s",
        message.pk, message.to, message.attempts, retry_at.isoformat(), error,
    )  # fmt: skip
    message.schedule_retry(error, retry_at)


def backoff(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones: doubling from
    PORTAL_MAIL_RETRY_SECONDS up to PORTAL_MAIL_RETRY_MAX_SECONDS, with half of it
    random so messages that failed together do not all come back at once."""
    base = settings.PORTAL_MAIL_RETRY_SECONDS
    cap = settings.PORTAL_MAIL_RETRY_MAX_SECONDS
    delay = min(cap, base * 2 ** min(max(attempts - 1, 0), 32))
    return delay / 2 + random.uniform(0, delay / 2)  # noqa: S311 (jitter, not secrecy)


def _is_permanent(exc: Exception) -> bool:
    """Every recipient refused with a 5xx code: no retry will change the answer."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused) and exc.recipients:
        return all(code >= 500 for code, _ in exc.recipients.values())
    return False


def _describe(exc: Exception) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"[:2000]


def _as_email(message: OutboxMessage) -> EmailMultiAlternatives:
    email = EmailMultiAlternatives(
        subject=message.subject,
        body=message.body or message.html_body,
        from_email=message.from_email or None,
        to=message.recipients,
        headers={"Message-ID": message.message_id},
    )
    if not message.body:
        email.content_subtype = "html"
    elif message.html_body:
        email.attach_alternative(message.html_body, "text/html")
    return email


def backlog() -> dict[str, int]:
    """For the site admin's dashboard: messages waiting for a retry (pending for more
    than a minute) and messages given up on in the last week."""
    now = timezone.now()
    return OutboxMessage.objects.aggregate(
        waiting=Count(
            "pk", filter=Q(state=OutboxState.PENDING, created_at__lt=now - WAITING_AFTER)
        ),
        failed=Count(
            "pk", filter=Q(state=OutboxState.FAILED, created_at__gte=now - FAILED_SHOWN_FOR)
        ),
    )

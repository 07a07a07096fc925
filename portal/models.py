"""The outbox: every email the portal sends is first a row here, written in the same
transaction as the change it reports, then delivered (and retried) from the row."""

from __future__ import annotations

import datetime as dt

from django.db import models
from django.utils import timezone


class OutboxState(models.TextChoices):
    PENDING = "pending", "Pending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"
    DROPPED = "dropped", "Not sent: no longer true"


class OutboxMessage(models.Model):
    """One rendered email. ``pending`` until the SMTP server accepts it (``sent``) or
    the portal gives up after PORTAL_MAIL_GIVE_UP_SECONDS (``failed``). A message stored
    to be written at its first attempt (``render_with``) whose news is no longer true
    by then is not sent (``dropped``).

    ``next_attempt_at`` is both the retry schedule and a lease: whoever claims the row
    moves it forward first (a conditional UPDATE), so a sender that dies mid-attempt
    leaves the row due again once the lease runs out, and two senders never both own
    it. The bodies are dropped once the message is sent: they may hold sign-in, reset
    or invite links that should not outlive the delivery in the database."""

    kind = models.CharField(max_length=100, help_text="The template the message was made from.")
    to = models.TextField(help_text="Recipients, comma-separated.")
    from_email = models.CharField(max_length=254, blank=True)
    subject = models.CharField(max_length=998)
    body = models.TextField(blank=True)
    html_body = models.TextField(blank=True)
    # A message written at its first attempt, from what is true then (``portal.mail.
    # send_later``): the renderer's name and what it is given. Cleared once the text is
    # stored, so every later attempt sends that same text.
    render_with = models.CharField(max_length=100, blank=True)
    render_args = models.JSONField(default=dict, blank=True)
    message_id = models.CharField(max_length=254, help_text="The same Message-ID on every attempt.")
    state = models.CharField(
        max_length=10, choices=OutboxState.choices, default=OutboxState.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    # True from a failed attempt until the row is claimed again: it waits out a back-off,
    # not a sender's lease, so a delivery that works again may make it due at once.
    backing_off = models.BooleanField(default=False)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["state", "next_attempt_at"], name="outbox_due"),
            models.Index(fields=["created_at"], name="outbox_created"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} to {self.to}"

    @property
    def recipients(self) -> list[str]:
        return [address for address in self.to.split(",") if address]

    def mark_sent(self, now: dt.datetime) -> None:
        """The SMTP server accepted the message."""
        self._finish(state=OutboxState.SENT, sent_at=now, last_error="", body="", html_body="")

    def schedule_retry(self, error: str, at: dt.datetime) -> None:
        """An attempt failed; the next one is due at ``at`` (sooner once the server
        takes another message)."""
        self._finish(last_error=error, next_attempt_at=at, backing_off=True)

    def mark_failed(self, error: str) -> None:
        """Attempts failed for longer than the portal keeps trying."""
        self._finish(state=OutboxState.FAILED, last_error=error)

    def write(self, subject: str, body: str) -> None:
        """The text of a message written at its first attempt, kept for every later
        one."""
        self._finish(subject=subject, body=body, render_with="", render_args={})

    def drop(self, why: str) -> None:
        """A message written at its first attempt had nothing true left to say."""
        self._finish(state=OutboxState.DROPPED, last_error=why, render_with="", render_args={})

    def _finish(self, **fields) -> None:
        # Only a pending row changes: a late result never reopens a finished one.
        OutboxMessage.objects.filter(pk=self.pk, state=OutboxState.PENDING).update(**fields)
        for name, value in fields.items():
            setattr(self, name, value)


class HistogramBucket(models.Model):
    """How many observations of one histogram series fell into one of its buckets, and
    their sum: a row per (metric, label values, bucket), added to by one upsert per
    observation (``portal.metrics.histograms.observe``) from any process, web or
    worker, and read whole by ``/metrics``. The bucket is an index into the bounds the
    histogram declares in code; the last index is +Inf."""

    name = models.CharField(max_length=100)
    labels = models.CharField(max_length=300, help_text="The label values, a JSON list.")
    bucket = models.PositiveSmallIntegerField()
    samples = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0, help_text="The sum of the observations.")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["name", "labels", "bucket"], name="one_row_per_histogram_bucket"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name}{self.labels}[{self.bucket}]"

"""Whether the portal's account can log in to a TPU VM's workers: the lab's key line
in the node's ``ssh-keys`` metadata, and what each worker answered since."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class ConnectionState(models.TextChoices):
    DISCONNECTED = "disconnected", "Not connected"
    CONNECTING = "connecting", "Connecting"
    CONNECTED = "connected", "Connected"
    FAILED = "failed", "Failed"


class VmConnection(models.Model):
    """The lab's key on one TPU VM: the state of the last Connect or Disconnect, why it
    failed, and per worker whether it accepts the lab's key (``workers`` maps the
    worker index, as text, to ``{"state": "waiting|accepted|refused", "detail": …}``)."""

    State = ConnectionState

    vm = models.OneToOneField("tpus.TpuVm", on_delete=models.CASCADE, related_name="connection")
    state = models.CharField(
        max_length=12, choices=ConnectionState.choices, default=ConnectionState.DISCONNECTED
    )
    reason = models.TextField(blank=True)
    workers = models.JSONField(default=dict, blank=True)
    requested_by = models.ForeignKey(
        "accounts.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # A new Connect bumps it; a check still running for an older one stops writing.
    attempt = models.PositiveIntegerField(default=0)
    # The attempt's checks so far: each is one short task that looks at every worker
    # once and queues the next with a countdown; the one holding the current number
    # runs, so a check queued twice (the sweep, a lost task found again) runs once.
    checks = models.PositiveIntegerField(default=0)
    # When the next check is due (while one runs: when it should have ended); a
    # connecting row long past it lost its task, and the sweep queues it again.
    next_check_at = models.DateTimeField(null=True, blank=True)
    # Set while a check of this VM tries its workers: one at a time per lab, so a lab's
    # burst of Connects to workers that hang never takes more than one Celery worker.
    looking_until = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.vm} {self.state}"

    @property
    def in_flight(self) -> bool:
        return self.state == ConnectionState.CONNECTING

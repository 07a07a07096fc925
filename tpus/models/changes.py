"""A stop, start or deletion of a TPU VM underway at Google."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class VmChange(models.Model):
    """A stop, start or deletion the API took as a long-running operation (Google takes
    minutes): short tasks look at the operation, each queued with a countdown, until it
    is done or ``TPU_API_OPERATION_TIMEOUT`` has passed. Deleting a VM made from a
    queued request cancels the request first (step ``request``), then the node."""

    class Step(models.TextChoices):
        REQUEST = "request", "Queued request"
        NODE = "node", "Node"

    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="changes")
    action = models.CharField(max_length=6)  # stop, start, delete
    step = models.CharField(max_length=7, choices=Step.choices, default=Step.NODE)
    operation = models.CharField(max_length=500)  # the API's operation name
    started_at = models.DateTimeField(default=timezone.now)
    # The next look is due then (while a look runs: its lease). Long past it and not
    # finished, the look's task was lost, and the sweep queues it again.
    claimed_until = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.action} {self.vm} ({self.step})"

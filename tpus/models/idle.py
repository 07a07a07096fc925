"""Chips held idle, one row per holding, as the lab's policy on idle chips follows it."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class IdleHolding(models.Model):
    """One holding of a VM's chips the idle pass watches: a portal job (``job``) or a
    process the portal did not start (``worker``, ``pid``, ``start``: its start time,
    so a pid taken by another process is another holding). The steps taken are kept
    here so none is taken twice: ``idle_since`` (the duty cycle of every chip it holds
    stayed below the lab's threshold since then), ``warned_at`` (the holder was told),
    ``admins_told_at`` and ``released_at`` (the job was cancelled or the process ended
    by the lab's policy). A holding whose chips are busy again starts over; one that
    ended on its own is forgotten (``services.idle_holders``)."""

    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="idle_holdings")
    job = models.OneToOneField(
        "tpus.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="idle_holding"
    )
    worker = models.PositiveSmallIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    start = models.BigIntegerField(null=True, blank=True)
    # Whom it concerns: the job's person, or the portal account of the process's unix
    # user (None when no account has that name).
    person = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )  # fmt: skip
    unix_user = models.CharField(max_length=64, blank=True)
    command = models.CharField(max_length=200, blank=True)
    # What it holds as last seen: [[worker, chip], …] and their HBM in use (bytes).
    chips = models.JSONField(default=list, blank=True)
    hbm_used = models.BigIntegerField(default=0)
    idle_since = models.DateTimeField(null=True, blank=True)
    warned_at = models.DateTimeField(null=True, blank=True)
    admins_told_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    # What the release did ("cancelled job 12", "TERM was enough", …) or why it could not.
    outcome = models.CharField(max_length=300, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["vm", "worker", "pid", "start"],
                condition=models.Q(job__isnull=True),
                name="one_idle_holding_per_process",
            )
        ]
        ordering = ["vm", "pk"]

    def __str__(self) -> str:
        return self.what

    @property
    def what(self) -> str:
        """The holding in words: ``job 12`` or ``process 4242 of milo on worker 0``."""
        if self.job_id:
            return f"job {self.job_id}"
        return f"process {self.pid} of {self.unix_user or '?'} on worker {self.worker}"

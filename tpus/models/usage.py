"""Worker-time per day, lab, person and TPU VM: what the usage page sums instead of
every job of the period."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import models


class UsageDay(models.Model):
    """The ended jobs of ``user`` on ``vm`` on one ``day`` (whole days in the portal's
    time zone): their worker-time and chip-time (time × the VM's chips, as the pool's
    fair share counts) inside that day, how many started that day, and how
    many were already running at its first moment (so a period counts each job once:
    those carried into its first day plus those started in it). A job is added once,
    when it has ended (``Job.usage_counted``); a running one is read from the jobs."""

    day = models.DateField()
    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="+")
    started = models.PositiveIntegerField(default=0)
    carried = models.PositiveIntegerField(default=0)
    worker_time = models.DurationField(default=dt.timedelta)
    chip_time = models.DurationField(default=dt.timedelta)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "day", "user", "vm"], name="one_usage_day_per_person_and_vm"
            )
        ]
        indexes = [
            models.Index(fields=["lab", "user", "day"]),
            models.Index(fields=["lab", "vm", "day"]),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.user_id} {self.vm_id}"

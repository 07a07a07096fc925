"""A person's standing in a lab's pool: the share the lab gives them and their recent
use, kept decayed so that the scheduler reads one row per person."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

MIN_SHARE = Decimal("0.01")
MAX_SHARE = Decimal("1000")


class FairShare(models.Model):
    """``user``'s share of ``lab``'s pool (1 unless a lab admin set it) and their
    recent use: chip-hours of their ended jobs in the lab, each hour weighed down by
    half every half-life of the lab since it was used, as of ``decayed_at``. Jobs are
    added once, when usage counts them (``Job.usage_counted``); running ones, and
    ended ones not counted yet, are read from the jobs (``services.fair_share``)."""

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="fair_shares")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="fair_shares"
    )
    share = models.DecimalField(
        max_digits=7,
        decimal_places=2,
        default=Decimal(1),
        validators=[MinValueValidator(MIN_SHARE), MaxValueValidator(MAX_SHARE)],
        help_text="Jobs are ordered by recent use divided by the share: a person with a "
        "share of 2 may use twice the chip-hours of one with 1 before their jobs wait.",
    )
    # Chip-hours, decayed up to ``decayed_at``.
    use = models.FloatField(default=0.0)
    decayed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lab", "user"], name="one_fair_share_per_person")
        ]

    def __str__(self) -> str:
        return f"{self.user_id} in {self.lab_id}: share {self.share}, use {self.use:.2f}"

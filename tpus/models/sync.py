"""How the periodic inventory sync went for each zone of each lab."""

from __future__ import annotations

from django.db import models


class ZoneSync(models.Model):
    """The last listing of one lab's zone (one ListNodes per project and zone): when
    it last succeeded, when it last failed and why, and since when it has been
    failing. ``alerted_at`` is set by the one sync that tells the lab's admins the
    listing has been failing too long; the sync that sees it work again clears it
    and sends the one recovery email."""

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="zone_syncs")
    zone = models.CharField(max_length=40)
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    # Null while the listing works: the first failure of the current outage.
    failing_since = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    alerted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lab", "zone"], name="one_sync_status_per_zone")
        ]
        ordering = ["lab", "zone"]

    def __str__(self) -> str:
        return f"{self.lab} {self.zone}"

    @property
    def failing(self) -> bool:
        return self.failing_since is not None

"""A short history of each chip's runtime metrics, as the job poll read them."""

from __future__ import annotations

from django.db import models


class ChipSample(models.Model):
    """One chip of one worker of ``vm`` at ``at``: HBM used and total (bytes) and the
    TensorCore duty cycle (percent), as its libtpu served them to the job poll. Kept
    for ``PORTAL_CHIP_METRICS_KEEP_MINUTES`` and written at most once per
    ``PORTAL_CHIP_METRICS_EVERY_SECONDS`` per VM, so a chip has a bounded number of
    samples (``services.chip_metrics``)."""

    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="chip_samples")
    worker = models.PositiveSmallIntegerField()
    chip = models.PositiveSmallIntegerField()
    at = models.DateTimeField()
    hbm_used = models.BigIntegerField()
    hbm_total = models.BigIntegerField()
    duty = models.FloatField()

    class Meta:
        indexes = [models.Index(fields=["vm", "at"], name="chip_sample_vm_at")]
        ordering = ["vm", "worker", "chip", "at"]

    def __str__(self) -> str:
        return f"{self.vm_id}/{self.worker}/{self.chip} at {self.at:%H:%M:%S}"

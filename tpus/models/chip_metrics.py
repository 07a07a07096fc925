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


class VmDutyDay(models.Model):
    """How busy ``vm``'s chips were on one ``day`` (a whole day in the portal's time
    zone, as the usage rows' days are), folded in at each reading of its metrics:
    ``observed``, the seconds between readings counted (each interval up to a cap, so
    a gap with no reading is not counted), and ``duty``, those seconds times the mean
    duty cycle of the chips read (a fraction), so ``duty / observed`` is the day's mean
    duty cycle while observed; ``hbm_peak``, the largest share of a chip's HBM in use
    at a reading. Kept like the usage rows: as long as the VM."""

    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="+")
    day = models.DateField()
    observed = models.FloatField(default=0.0)
    duty = models.FloatField(default=0.0)
    hbm_peak = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["vm", "day"], name="one_duty_day_per_vm")]

    def __str__(self) -> str:
        return f"{self.vm_id} {self.day}"

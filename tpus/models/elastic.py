"""Elastic pools: per accelerator type of a lab, the portal asks Google for a VM of the
type (a queued request) when jobs of that kind wait and none can take them, and
deletes a VM it made that way once it has run nothing for the pool's idle limit.
Off until a lab admin switches it on for a type."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from tpus.models.provisioning import Provisioning

DEFAULT_IDLE_MINUTES = 30


class ElasticPool(models.Model):
    """An elastic pool of one accelerator type of a lab: what its VMs are asked for
    with (spot or preemptible, zones, runtime version), how long one may sit idle, and
    at most how many it may hold. Its VMs are those made by a request naming it
    (``VmRequest.elastic_pool``). ``refused`` says why the last pass did not grow it
    though jobs waited (blank when it grew or needed nothing)."""

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="elastic_pools")
    accelerator_type = models.CharField(max_length=40)
    enabled = models.BooleanField(default=False)
    provisioning = models.CharField(
        max_length=12,
        choices=[(p.value, p.label) for p in (Provisioning.SPOT, Provisioning.PREEMPTIBLE)],
        default=Provisioning.SPOT,
    )
    zones = models.JSONField(default=list)
    runtime_version = models.CharField(max_length=100)
    idle_minutes = models.PositiveIntegerField(default=DEFAULT_IDLE_MINUTES)
    max_vms = models.PositiveIntegerField(null=True, blank=True)
    # The number in the next VM's name (``v4-8-pool-7``): names are never reused, as a
    # deleted VM's row keeps its name.
    next_number = models.PositiveIntegerField(default=1)
    refused = models.TextField(blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)
    changed_at = models.DateTimeField(default=timezone.now)
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "accelerator_type"], name="one_elastic_pool_per_kind"
            )
        ]
        ordering = ["accelerator_type"]

    def __str__(self) -> str:
        return f"{self.lab}: {self.accelerator_type} elastic pool"

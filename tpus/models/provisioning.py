"""TPU VMs the portal makes for a lab: what the lab may hold at once (its allowance,
as a TRC grant states it), and each request to make one, followed from the call to the
Cloud TPU API until the VM is up in the lab (or the request failed or was cancelled)."""

from __future__ import annotations

import re

from django.conf import settings
from django.db import models
from django.utils import timezone

from tpus.models.inventory import validate_accelerator_type, validate_node_name

_TYPE = re.compile(r"^(v[0-9]+[a-z]*?)(litepod)?-([0-9]+)$")
# Generations whose type names count chips (v5litepod-8: 8 chips); the others count
# TensorCores, two per chip (v4-32: 16 chips).
COUNTS_CHIPS = {"v5litepod", "v5e", "v6e"}


def chips_of(accelerator_type: str) -> tuple[str, int]:
    """(generation, chips) of a type name: ``v4-32`` → ("v4", 16), ``v5litepod-8`` →
    ("v5litepod", 8). ("", 0) for a name that is not a TPU type."""
    match = _TYPE.fullmatch(accelerator_type or "")
    if not match:
        return "", 0
    generation = match[1] + (match[2] or "")
    size = int(match[3])
    return generation, size if generation in COUNTS_CHIPS else max(1, size // 2)


class Provisioning(models.TextChoices):
    ON_DEMAND = "on-demand", "On-demand"
    SPOT = "spot", "Spot"
    PREEMPTIBLE = "preemptible", "Preemptible"


class LabAllowance(models.Model):
    """How many chips of one TPU generation a lab may hold at once, of one kind
    (on-demand, spot, preemptible), as its TRC grant says ("5 on-demand v3-8" is 20 v3
    chips). The lab's ``grant_end_date`` ends every allowance. Site admins set it."""

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="allowances")
    generation = models.CharField(max_length=12, help_text="v2, v3, v4, v5litepod, v5p, v6e")
    provisioning = models.CharField(max_length=12, choices=Provisioning.choices)
    chips = models.PositiveIntegerField()

    class Meta:
        ordering = ["generation", "provisioning"]
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "generation", "provisioning"], name="one_allowance_per_kind"
            )
        ]

    def __str__(self) -> str:
        return f"{self.lab}: {self.chips} {self.provisioning} {self.generation} chips"


class VmRequestState(models.TextChoices):
    REQUESTED = "requested", "Requested"  # stored, the call to the API not made yet
    WAITING = "waiting", "Waiting for resources"
    PROVISIONING = "provisioning", "Provisioning"
    READY = "ready", "Up"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


OPEN_REQUEST_STATES = (
    VmRequestState.REQUESTED,
    VmRequestState.WAITING,
    VmRequestState.PROVISIONING,
)


class VmRequest(models.Model):
    """A lab admin's request for a TPU VM: made at once (``CreateNode``) or queued
    until capacity comes (a queued resource, ``cloud_id``), within an optional window.
    Once the node is up it is registered in the lab (``vm``), connected with the lab's
    key from the start."""

    State = VmRequestState

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="vm_requests")
    name = models.CharField(max_length=63, validators=[validate_node_name])
    zone = models.CharField(max_length=40)
    accelerator_type = models.CharField(max_length=40, validators=[validate_accelerator_type])
    runtime_version = models.CharField(max_length=100)
    provisioning = models.CharField(
        max_length=12, choices=Provisioning.choices, default=Provisioning.ON_DEMAND
    )
    queued = models.BooleanField(default=False)
    valid_after = models.DateTimeField(null=True, blank=True)
    valid_until = models.DateTimeField(null=True, blank=True)
    keep_alive = models.BooleanField(default=False)
    state = models.CharField(
        max_length=12, choices=VmRequestState.choices, default=VmRequestState.REQUESTED
    )
    error_code = models.CharField(max_length=40, blank=True)
    error = models.TextField(blank=True)
    cloud_id = models.CharField(max_length=63, blank=True)
    vm = models.ForeignKey(
        "tpus.TpuVm", null=True, blank=True, on_delete=models.SET_NULL, related_name="requests"
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    waiting_since = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    changed_at = models.DateTimeField(default=timezone.now)
    # While a look at ``operation`` is queued: when it is due (the pass leaves the
    # request to it until then); while a task works on the request: its lease.
    claimed_until = models.DateTimeField(null=True, blank=True)
    # The Cloud TPU API's long-running operation the request waits for (its create, the
    # deletion of what would hold its name, or its own withdrawal), the call that
    # started it and when: short tasks queued with a countdown look at it, so no task
    # waits for Google. Blank when none is underway.
    operation = models.CharField(max_length=500, blank=True)
    operation_call = models.CharField(max_length=30, blank=True)
    operation_sent_at = models.DateTimeField(null=True, blank=True)
    # A VM kept alive that Google took back and the portal did not ask for again: why
    # (its chips are not free, the lab's grant ended) and since when. Each keep-alive
    # pass checks again; the row keeps the duty until the VM is asked for.
    kept_down = models.TextField(blank=True)
    kept_down_since = models.DateTimeField(null=True, blank=True)
    # Asked for by the lab's elastic pool of its type (not by an admin), and why then
    # ("3 jobs wait; allowance 2 of 5 v4-8 in use"). Its VM is the pool's, deleted by
    # the pool once idle.
    elastic_pool = models.ForeignKey(
        "tpus.ElasticPool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="requests",
    )
    elastic_reason = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "zone", "name"],
                condition=models.Q(state__in=["requested", "waiting", "provisioning"]),
                name="one_open_request_per_vm_name",
            )
        ]
        indexes = [models.Index(fields=["state"], name="vm_request_state_idx")]

    def __str__(self) -> str:
        return f"{self.name} in {self.zone} ({self.get_state_display()})"

    @property
    def chips(self) -> int:
        return chips_of(self.accelerator_type)[1]

    @property
    def is_open(self) -> bool:
        return self.state in OPEN_REQUEST_STATES


class LabNotice(models.Model):
    """A message about a lab sent once: the row is the claim (a second run's insert
    fails on the unique key), e.g. the week-ahead warning that the lab's TPU grant and
    allowance end on ``about``."""

    class Kind(models.TextChoices):
        GRANT_ENDING = "grant_ending", "The lab's TPU grant ends soon"

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="notices")
    kind = models.CharField(max_length=20, choices=Kind.choices)
    about = models.DateField()
    sent_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lab", "kind", "about"], name="one_notice_per_date")
        ]

    def __str__(self) -> str:
        return f"{self.lab}: {self.get_kind_display()} ({self.about})"

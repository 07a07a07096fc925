"""The lab's TPU VMs, their workers, and data disks: what the portal believes exists,
refreshed from the Cloud TPU API (or entered by an admin for VMs it cannot see)."""

from __future__ import annotations

import functools
import re

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from tpus.remote import rules

# Cloud TPU node ids: lowercase letters, digits and hyphens, starting with a letter.
validate_node_name = RegexValidator(
    r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?\Z",
    "A TPU VM name is up to 63 lowercase letters, digits or hyphens, starting with a "
    "letter and not ending with a hyphen.",
)
validate_disk_name = RegexValidator(
    r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?\Z",
    "A disk name is up to 63 lowercase letters, digits or hyphens, starting with a letter.",
)
validate_accelerator_type = RegexValidator(
    r"^v[0-9]+[a-z]*(?:litepod)?-[0-9]+\Z", "An accelerator type looks like v4-32 or v5litepod-8."
)


@functools.lru_cache(maxsize=256)
def chip_count(accelerator_type: str, default: int = 1) -> int:
    """How many chips a VM of the type has. v2, v3, v4 and v5p names count
    TensorCores (two per chip); v5e (v5litepod) and v6e names count chips."""
    match = re.fullmatch(r"(v[0-9]+[a-z]*?)(litepod)?-([0-9]+)", accelerator_type or "")
    if not match:
        return default
    generation = match[1] + (match[2] or "")
    size = int(match[3])
    return size if generation in ("v5litepod", "v5e", "v6e") else max(1, size // 2)


def validate_mount_point(value: str) -> None:
    """The hosts' rule for mount points (``tpus.remote.rules``)."""
    if (problem := rules.mount_point_problem(value)) is not None:
        raise ValidationError(problem)


class NodeState(models.TextChoices):
    """The API's Node.State names, plus UNKNOWN for VMs the API cannot see."""

    UNKNOWN = "UNKNOWN", "Unknown"
    CREATING = "CREATING", "Creating"
    READY = "READY", "Ready"
    RESTARTING = "RESTARTING", "Restarting"
    REIMAGING = "REIMAGING", "Reimaging"
    DELETING = "DELETING", "Deleting"
    REPAIRING = "REPAIRING", "Repairing"
    STOPPED = "STOPPED", "Stopped"
    STOPPING = "STOPPING", "Stopping"
    STARTING = "STARTING", "Starting"
    PREEMPTED = "PREEMPTED", "Preempted"
    TERMINATED = "TERMINATED", "Terminated"
    HIDING = "HIDING", "Hiding"
    HIDDEN = "HIDDEN", "Hidden"
    UNHIDING = "UNHIDING", "Unhiding"


class NodeHealth(models.TextChoices):
    UNKNOWN = "HEALTH_UNSPECIFIED", "Unknown"
    HEALTHY = "HEALTHY", "Healthy"
    TIMEOUT = "TIMEOUT", "Timeout"
    UNHEALTHY_TENSORFLOW = "UNHEALTHY_TENSORFLOW", "Unhealthy (runtime)"
    UNHEALTHY_MAINTENANCE = "UNHEALTHY_MAINTENANCE", "Under maintenance"


class VmSource(models.TextChoices):
    IMPORTED = "imported", "Imported from the Cloud TPU API"
    MANUAL = "manual", "Registered by hand"
    CREATED = "created", "Created by the portal"


# VMs the Cloud TPU API knows: it lists them, and their metadata and disks can be
# changed through it (not so for a VM registered by hand).
API_SOURCES = (VmSource.IMPORTED, VmSource.CREATED)


class DiskMode(models.TextChoices):
    READ_ONLY = "READ_ONLY", "Read-only"
    READ_WRITE = "READ_WRITE", "Read-write"


class TpuVm(models.Model):
    """A TPU VM (a Cloud TPU node) of a lab. Every worker of it is a host the portal
    provisions; a v4-32 pod has four."""

    State = NodeState
    Health = NodeHealth

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="vms")
    name = models.CharField(max_length=63, validators=[validate_node_name])
    zone = models.CharField(max_length=40)
    accelerator_type = models.CharField(
        max_length=40, blank=True, validators=[validate_accelerator_type]
    )
    topology = models.CharField(max_length=20, blank=True)
    runtime_version = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=12, choices=NodeState.choices, default=NodeState.UNKNOWN)
    health = models.CharField(max_length=24, choices=NodeHealth.choices, default=NodeHealth.UNKNOWN)
    health_description = models.CharField(max_length=500, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    preemptible = models.BooleanField(default=False)
    source = models.CharField(max_length=10, choices=VmSource.choices)
    created_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(
        null=True, blank=True, help_text="When the Cloud TPU API last listed it."
    )
    missing_since = models.DateTimeField(
        null=True, blank=True, help_text="Set when the API stopped listing it; kept, not deleted."
    )
    # Bumped by every change the hosts must follow (grants, keys, disks); workers
    # record the version they applied (WorkerSync.applied_version).
    desired_version = models.PositiveIntegerField(default=0)
    # One reconcile at a time: claimed with a conditional UPDATE, expires by itself.
    # Each run's claim has its own token (renewed and released only by that run) and
    # says which desired version the run is applying, so a revoke that run does not
    # carry can take the VM over at once (``services.reconcile``).
    reconcile_claimed_until = models.DateTimeField(null=True, blank=True)
    reconcile_claim = models.CharField(max_length=32, blank=True, default="")
    reconcile_claim_version = models.PositiveIntegerField(default=0)
    # The node's create_time as the API reports it: another one means the VM was
    # deleted and created again under the same name, with new hosts.
    node_created_at = models.DateTimeField(null=True, blank=True)
    # A VM kept alive that came back on new machines is set up again (accounts, keys,
    # disks) before it is whole: until every worker has applied this desired version,
    # jobs wait; then the people with access are told it is back, once, and it is
    # ``restored_at``. None when nothing is being restored.
    restore_version = models.PositiveIntegerField(null=True, blank=True)
    restored_at = models.DateTimeField(null=True, blank=True)
    # Jobs: one pass over the VM's queue at a time (start, poll, cancel), claimed like
    # a reconcile; and what the last look at the workers found holding a chip outside
    # the portal ([{worker, device, pid, user, command}]) and when.
    jobs_claimed_until = models.DateTimeField(null=True, blank=True)
    # A pass found the VM held by another: the holder passes again once it ends, so a
    # job submitted meanwhile starts then, not at the next poll.
    jobs_pass_wanted = models.BooleanField(default=False)
    outside_holders = models.JSONField(default=list, blank=True)
    usage_checked_at = models.DateTimeField(null=True, blank=True)
    # Set by a lab admin: the lab's policy on idle chips leaves whoever holds this VM's
    # chips alone (``services.idle_holders``).
    idle_exempt = models.BooleanField(default=False)
    # When the idle pass last looked at the VM: the least recently looked at go first.
    idle_looked_at = models.DateTimeField(null=True, blank=True, editable=False)
    # When the scheduled pass last asked for such a look (answered or not), so a VM
    # whose workers cannot answer does not keep its place at the head of the line
    # (``services.holders``).
    holders_looked_at = models.DateTimeField(null=True, blank=True)
    # The chips' runtime metrics as the last poll read them, per worker
    # ([{worker, chips: [{chip, used, total, duty}], none: why there are none}]), and
    # when (``services.chip_metrics``; the history is in ChipSample).
    chip_metrics = models.JSONField(default=list, blank=True)
    chip_metrics_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lab", "zone", "name"], name="one_vm_per_name")
        ]
        ordering = ["name"]
        verbose_name = "TPU VM"

    def __str__(self) -> str:
        return self.name

    @property
    def is_missing(self) -> bool:
        return self.missing_since is not None


class HostKeySource(models.TextChoices):
    GUEST_ATTRIBUTES = "guest_attributes", "Guest attributes at import"
    ADMIN = "admin", "Confirmed by an admin"
    NONE = "", "Not pinned"


class Worker(models.Model):
    """One host of a TPU VM (``network_endpoints[index]``) with the SSH host keys the
    portal pinned for it. A pinned key never changes without an admin."""

    vm = models.ForeignKey(TpuVm, on_delete=models.CASCADE, related_name="workers")
    index = models.PositiveSmallIntegerField()
    internal_ip = models.GenericIPAddressField(null=True, blank=True)
    external_ip = models.GenericIPAddressField(null=True, blank=True)
    # "type base64" lines, as in known_hosts without the host part.
    host_keys = models.JSONField(default=list, blank=True)
    host_keys_source = models.CharField(
        max_length=20, choices=HostKeySource.choices, default=HostKeySource.NONE, blank=True
    )
    host_keys_pinned_at = models.DateTimeField(null=True, blank=True)
    host_keys_pinned_by = models.ForeignKey(
        "accounts.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    boot_id = models.CharField(max_length=64, blank=True)
    # A host that presented another key than the pinned one: provisioning stops for
    # this worker until an admin looks. The key it showed is kept for that review.
    host_key_mismatch_at = models.DateTimeField(null=True, blank=True)
    presented_host_key = models.TextField(blank=True)
    # The alarm came only from the keys the Cloud TPU API publishes (guest attributes,
    # which any process on the VM may write): the worker is still provisioned, since
    # the connection checks the pinned key, and the admins are told to look. A key the
    # worker presents differently still stops it. When the admins were last emailed
    # about this worker's alarm (repeats are rate-limited).
    host_key_alarm_published = models.BooleanField(default=False)
    host_key_alerted_at = models.DateTimeField(null=True, blank=True)
    # The host keys the Cloud TPU API published for this worker (guest attributes
    # ``hostkeys/``) when they were last compared with the pins, and when that was.
    # ``published_keys_recheck`` asks the next sync to compare them again (a reboot).
    published_host_keys = models.JSONField(default=list, blank=True)
    published_keys_checked_at = models.DateTimeField(null=True, blank=True)
    published_keys_recheck = models.BooleanField(default=False)
    # Raised whenever the portal forgets how it reached the worker (Disconnect, a host
    # key changed or forgotten): an SSH connection kept open from before is never used
    # again (``tpus.remote.kept``).
    ssh_generation = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["vm", "index"], name="one_worker_per_index")]
        ordering = ["vm", "index"]

    def __str__(self) -> str:
        return f"{self.vm.name} worker {self.index}"

    @property
    def alias(self) -> str:
        """The stable name used for this worker in ssh configs and known_hosts."""
        return worker_alias(self.vm.name, self.index)

    @property
    def is_pinned(self) -> bool:
        return bool(self.host_keys)

    @property
    def last_sync(self):
        """What the worker did in its last reconcile (its ``WorkerSync``), or None
        before any reconcile reached it. Load it with ``select_related("sync")``."""
        try:
            return self.sync
        except models.ObjectDoesNotExist:
            return None

    def published_key_changes(self) -> list[str]:
        """The published host keys that contradict the pinned ones (see
        ``published_key_changes``); empty when what the API published is no change."""
        return published_key_changes(self.host_keys, self.published_host_keys)


def worker_alias(vm_name: str, index: int) -> str:
    """``Worker.alias`` from the VM's name and the worker's index (for plain rows)."""
    return f"{vm_name}-w{index}"


def published_key_changes(pinned: list[str], published: list[str]) -> list[str]:
    """Which published ``"type base64"`` lines say the worker's host keys changed.

    A key type that is both pinned and published with another key is a change. So is
    a published set that shares no key type with the pins (nothing published confirms
    them). Not a change: nothing published (the guest agent has not written the keys
    yet, or guest attributes are off), a published set equal to the pins, one that
    lacks some pinned type, or one that only adds a type the portal does not pin."""
    if not pinned or not published:
        return []
    pins = {line.split()[0]: line.split()[1] for line in pinned if len(line.split()) >= 2}
    offered = {line.split()[0]: line for line in published if len(line.split()) >= 2}
    common = pins.keys() & offered.keys()
    if not common:
        return sorted(offered.values())
    return sorted(offered[t] for t in common if offered[t].split()[1] != pins[t])


class DataDisk(models.Model):
    """A persistent disk of the lab's project that can be attached to TPU VMs and is
    mounted on every worker at its mount point."""

    Mode = DiskMode

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="disks")
    name = models.CharField(max_length=63, validators=[validate_disk_name])
    zone = models.CharField(max_length=40)
    size_gb = models.PositiveIntegerField(null=True, blank=True)
    mount_point = models.CharField(
        max_length=200, default="/ssd", validators=[validate_mount_point]
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lab", "zone", "name"], name="one_disk_per_name")
        ]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def source_disk(self) -> str:
        return f"projects/{self.lab.gcp_project_id}/zones/{self.zone}/disks/{self.name}"


class AttachmentState(models.TextChoices):
    ATTACHED = "attached", "Attached"
    # Being detached: no longer mounted on the workers; the Cloud TPU API detaches it
    # once every worker has unmounted it (``services.disk_operations``).
    DETACHING = "detaching", "Detaching"


class DiskAttachment(models.Model):
    """A data disk attached to a TPU VM, read-only (to many VMs) or read-write (to one)."""

    State = AttachmentState

    disk = models.ForeignKey(DataDisk, on_delete=models.CASCADE, related_name="attachments")
    vm = models.ForeignKey(TpuVm, on_delete=models.CASCADE, related_name="attachments")
    mode = models.CharField(max_length=10, choices=DiskMode.choices, default=DiskMode.READ_ONLY)
    attached_at = models.DateTimeField(default=timezone.now)
    state = models.CharField(
        max_length=10, choices=AttachmentState.choices, default=AttachmentState.ATTACHED
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["disk", "vm"], name="one_attachment_per_vm")]

    def __str__(self) -> str:
        return f"{self.disk} on {self.vm} ({self.mode})"


class DiskOperationState(models.TextChoices):
    PENDING = "pending", "Waiting"
    RUNNING = "running", "In progress"
    # A detach waits here until every worker has unmounted the disk.
    UNMOUNTING = "unmounting", "Unmounting on the workers"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


IN_FLIGHT_OPERATIONS = (
    DiskOperationState.PENDING,
    DiskOperationState.RUNNING,
    DiskOperationState.UNMOUNTING,
)


class DiskOperation(models.Model):
    """An attach or detach an admin asked for. The Cloud TPU API does it as a
    long-running operation, so it runs in a task; the disk's page shows its progress."""

    class Action(models.TextChoices):
        ATTACH = "attach", "Attach"
        DETACH = "detach", "Detach"

    State = DiskOperationState

    disk = models.ForeignKey(DataDisk, on_delete=models.CASCADE, related_name="operations")
    vm = models.ForeignKey(TpuVm, on_delete=models.CASCADE, related_name="disk_operations")
    action = models.CharField(max_length=6, choices=Action.choices)
    mode = models.CharField(max_length=10, choices=DiskMode.choices, default=DiskMode.READ_ONLY)
    state = models.CharField(
        max_length=12, choices=DiskOperationState.choices, default=DiskOperationState.PENDING
    )
    error = models.TextField(blank=True)
    # A detach: the VM's desired version that no longer mounts the disk, and since when
    # the workers have been asked to unmount it (the wait is bounded).
    hosts_version = models.PositiveIntegerField(null=True, blank=True)
    unmount_started_at = models.DateTimeField(null=True, blank=True)
    requested_by = models.ForeignKey(
        "accounts.User", null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # While running: the worker that claimed it owns it until then. A worker that dies
    # leaves the lease to run out, and the periodic sweep hands the operation on. While
    # the change is underway at Google, no worker holds it: the lease ends when the
    # next look is due, and that look is queued with a countdown.
    claimed_until = models.DateTimeField(null=True, blank=True)
    # The API's long-running operation for the change, once sent, and when it was sent
    # (it fails after TPU_API_OPERATION_TIMEOUT).
    cloud_operation = models.CharField(max_length=500, blank=True)
    cloud_started_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.action} {self.disk} on {self.vm} ({self.state})"

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT_OPERATIONS


class ScanState(models.TextChoices):
    QUEUED = "queued", "Queued"
    SCANNING = "scanning", "Scanning"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class HostKeyScan(models.Model):
    """The last reading of the host keys a worker offers, started by an admin and run
    as queued work (``services.hostkey_scans``): one row per worker, reset by each new
    scan. ``address`` is where the keys were (or are being) read; the admin's
    confirmation is bound to the worker, this address and exactly these keys."""

    worker = models.OneToOneField(Worker, on_delete=models.CASCADE, related_name="key_scan")
    state = models.CharField(max_length=16, choices=ScanState.choices, default=ScanState.QUEUED)
    address = models.GenericIPAddressField()
    keys = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True)
    requested_by = models.ForeignKey(
        "accounts.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"host key scan of {self.worker} ({self.state})"

    @property
    def in_flight(self) -> bool:
        return self.state in {ScanState.QUEUED, ScanState.SCANNING}

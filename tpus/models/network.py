"""External IP changes of workers, and who was told about each."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class IpChange(models.Model):
    """A worker's external IP changed (seen by the periodic sync). Recorded once: the
    sync that wins the conditional update of the worker's address records it."""

    worker = models.ForeignKey("tpus.Worker", on_delete=models.CASCADE, related_name="ip_changes")
    old_ip = models.GenericIPAddressField(null=True, blank=True)
    new_ip = models.GenericIPAddressField()
    seen_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-seen_at", "-id"]

    def __str__(self) -> str:
        return f"{self.worker}: {self.old_ip} → {self.new_ip}"


class IpChangeNotice(models.Model):
    """One email to one person about one change. The unique constraint is what makes
    it exactly one, whatever runs twice."""

    change = models.ForeignKey(IpChange, on_delete=models.CASCADE, related_name="notices")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["change", "user"], name="one_notice_per_change")
        ]

    def __str__(self) -> str:
        return f"{self.user} about {self.change}"


class ConfigFeed(models.Model):
    """A person's private URL for their ssh config and known_hosts, for cron. The
    token is derived from the salt with the portal's secret, so it can be shown again
    (in emails) without being stored; a new salt revokes the old URL."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="config_feed"
    )
    salt = models.CharField(max_length=64)
    enabled = models.BooleanField(default=True)
    # True only when the person turned it on themselves: any sudoer on a VM can use a
    # forwarded agent, so no one (a lab admin included) turns it on for them. None
    # (never chosen) and False mean off.
    forward_agent = models.BooleanField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_fetched_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"ssh config feed of {self.user}"


FORWARD_PORT_MIN, FORWARD_PORT_MAX = 1024, 65535


class PortForward(models.Model):
    """A port on one of a person's TPU VMs that they reach on their own machine (for
    TensorBoard, Jupyter): a ``LocalForward local localhost:remote`` line in that VM's
    Host block of their ssh config. One local port forwards one thing per VM; ports
    below 1024 need root on the laptop and are privileged on the VM, so never."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="port_forwards"
    )
    vm = models.ForeignKey("tpus.TpuVm", on_delete=models.CASCADE, related_name="port_forwards")
    local_port = models.PositiveIntegerField()
    remote_port = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["local_port"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "vm", "local_port"], name="one_forward_per_local_port"
            ),
            models.CheckConstraint(
                condition=models.Q(local_port__gte=FORWARD_PORT_MIN)
                & models.Q(local_port__lte=FORWARD_PORT_MAX)
                & models.Q(remote_port__gte=FORWARD_PORT_MIN)
                & models.Q(remote_port__lte=FORWARD_PORT_MAX),
                name="forward_ports_in_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} {self.local_port} → {self.vm}:{self.remote_port}"

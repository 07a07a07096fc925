"""Workdir snapshots: the files a job carries to whichever VM it lands on.

A person's file contents are stored once each, by sha256, per person (``SnapshotBlob``,
never shared between people, so nobody learns whether another person has a file); a
``Snapshot`` is a manifest over them (path, size, mode, sha256 per file) in one lab,
named by the sha256 of its canonical form. ``services.snapshots`` checks, stores and
expires them; ``services.job_engine`` places them on the workers.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class SnapshotBlob(models.Model):
    """One file content a person stored (``blobs/<owner>/<sha256>`` in the storage)."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="snapshot_blobs"
    )
    sha256 = models.CharField(max_length=64)
    size = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "sha256"], name="one_blob_per_owner_and_hash")
        ]

    def __str__(self) -> str:
        return f"{self.sha256[:12]} of {self.owner_id}"


class Snapshot(models.Model):
    """A workdir as one person sent it in one lab: its files, their total size, and
    until when it is kept (``expires_at``, moved on each time a job needs it)."""

    lab = models.ForeignKey("tpus.Lab", on_delete=models.CASCADE, related_name="snapshots")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="snapshots"
    )
    # sha256 of the canonical manifest (``services.snapshots.digest_of``).
    digest = models.CharField(max_length=64)
    file_count = models.PositiveIntegerField()
    total_bytes = models.BigIntegerField()
    created_at = models.DateTimeField(default=timezone.now)
    last_needed_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["lab", "owner", "digest"], name="one_snapshot_per_owner_and_digest"
            )
        ]
        indexes = [models.Index(fields=["expires_at"])]

    def __str__(self) -> str:
        return f"snapshot {self.pk} ({self.digest[:12]})"


class SnapshotFile(models.Model):
    """One file of a snapshot: where it goes under the job's folder, and its content."""

    snapshot = models.ForeignKey(Snapshot, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=4096)
    size = models.BigIntegerField()
    # 0o644 or 0o755.
    mode = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)

    class Meta:
        ordering = ["snapshot", "path"]
        constraints = [
            models.UniqueConstraint(fields=["snapshot", "path"], name="one_file_per_snapshot_path")
        ]

    def __str__(self) -> str:
        return self.path

"""API endpoints of workdir snapshots: a job carries its code to whichever VM it lands
on (``services.snapshots``). The client asks which contents are missing, uploads
those, makes the snapshot, and submits a job with its id (``"snapshot": id``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ninja import Router, Schema, Status

from portal.schemas import Error
from tpus import access
from tpus.services import snapshots

router = Router(tags=["snapshots"])


class ManifestIn(Schema):
    """A workdir's files: ``[{"path": "src/a.py", "size": 123, "mode": 420, "sha256":
    "<64 hex>"}, ...]``. Paths are relative (no ``..``, ``.`` or empty parts, no
    control characters, at most 1024 bytes), modes 420 (0644) or 493 (0755)."""

    files: list[Any] = []


class MissingOut(Schema):
    """The contents (sha256) of the manifest you have not stored yet, the workdir's
    total bytes and the lab's cap on one snapshot."""

    missing: list[str]
    bytes: int
    cap_bytes: int


class SnapshotError(Error):
    """A refused manifest or upload: ``detail`` for people; ``errors`` by field
    (``files``: one message per bad file; ``bytes``, ``count``: a cap); ``missing``: the
    contents to upload before the snapshot can be made. Past a cap, the numbers: the
    workdir's ``bytes`` and the lab's ``cap_bytes`` on one snapshot; its ``files`` and
    ``cap_files``; or the ``bytes`` more to keep, the ``stored_bytes`` you keep and the
    ``person_cap_bytes`` one person may keep."""

    errors: dict[str, list[str]] = {}
    missing: list[str] | None = None
    bytes: int | None = None
    cap_bytes: int | None = None
    files: int | None = None
    cap_files: int | None = None
    stored_bytes: int | None = None
    person_cap_bytes: int | None = None


class BlobOut(Schema):
    sha256: str
    size: int


class SnapshotOut(Schema):
    """A snapshot: ``digest`` is the sha256 of the canonical manifest (files sorted by
    path, compact JSON ``[[path, size, mode, sha256], ...]``)."""

    id: int
    digest: str
    files: int
    bytes: int
    expires_at: datetime

    @staticmethod
    def resolve_files(obj):
        return obj.file_count

    @staticmethod
    def resolve_bytes(obj):
        return obj.total_bytes


def _refused(exc: snapshots.SnapshotRefused):
    body = {"detail": exc.detail, "errors": exc.errors}
    if exc.missing is not None:
        body["missing"] = exc.missing
    return Status(400, {**body, **exc.caps})


@router.post(
    "/labs/{slug}/snapshots/missing",
    response={200: MissingOut, 400: SnapshotError},
    summary="Which of a workdir's file contents you have not stored yet",
    description="Checks the manifest and the caps (the lab's on one snapshot, the site's "
    "on what one person keeps) before anything is uploaded. The answer is about your "
    "own stored contents only.",
)
def missing_blobs(request, slug: str, payload: ManifestIn):
    lab = access.get_member_lab(request.user, slug)
    try:
        return Status(200, snapshots.missing(request.user, lab, payload.files))
    except snapshots.SnapshotRefused as exc:
        return _refused(exc)


@router.put(
    "/labs/{slug}/snapshots/blobs/{sha256}",
    response={200: BlobOut, 201: BlobOut, 400: SnapshotError},
    summary="Upload one file content (the raw bytes, application/octet-stream)",
    description="Content-Length is required and checked against the caps before a byte "
    "is read; the body is hashed as it arrives and must have the sha256 of the path. "
    "201 when stored now, 200 when you had stored it already; nothing stays of a refused "
    "upload.",
)
def put_blob(request, slug: str, sha256: str):
    lab = access.get_member_lab(request.user, slug)
    try:
        blob, made = snapshots.store_blob(
            request.user, lab, sha256, request, request.META.get("CONTENT_LENGTH")
        )
    except snapshots.SnapshotRefused as exc:
        return _refused(exc)
    return Status(201 if made else 200, {"sha256": blob.sha256, "size": blob.size})


class BundleOut(Schema):
    """What an upload of many contents did: ``stored`` now, ``had`` (stored before),
    and the body's ``bytes``."""

    stored: int
    had: int
    bytes: int


@router.post(
    "/labs/{slug}/snapshots/blobs",
    response={200: BundleOut, 400: SnapshotError},
    summary="Upload many file contents in one body (application/octet-stream)",
    description="The body is the contents one after another, each as a line `<sha256> "
    "<size>` then its raw bytes (small files in one request rather than one each). "
    "Content-Length is required and checked against the caps before a byte is read; "
    "each content is hashed as it arrives and must have its sha256; all are stored or "
    "none (400 names the first that is wrong).",
)
def post_blobs(request, slug: str):
    lab = access.get_member_lab(request.user, slug)
    try:
        done = snapshots.store_bundle(
            request.user, lab, request, request.META.get("CONTENT_LENGTH")
        )
    except snapshots.SnapshotRefused as exc:
        return _refused(exc)
    return Status(200, done)


@router.post(
    "/labs/{slug}/snapshots",
    response={200: SnapshotOut, 201: SnapshotOut, 400: SnapshotError},
    summary="Make a snapshot of a workdir whose contents are all stored",
    description="201 with the new snapshot; 200 with the one made before when you send "
    "the same manifest again in the lab (kept longer); 400 with `missing` when a content "
    "is not stored yet. Pass its `id` as a job's `snapshot`.",
)
def create_snapshot(request, slug: str, payload: ManifestIn):
    lab = access.get_member_lab(request.user, slug)
    try:
        snapshot, made = snapshots.create_snapshot(request.user, lab, payload.files)
    except snapshots.SnapshotRefused as exc:
        return _refused(exc)
    return Status(201 if made else 200, snapshot)

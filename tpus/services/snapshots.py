"""Workdir snapshots: a job carries its code to whichever VM it lands on.

The client asks which of its files' contents the portal lacks (``missing``), uploads
those (``store_blob``), then names the manifest (``create_snapshot``) and submits a job
with the snapshot's id. Contents are stored once per person by sha256 in the storage
named ``snapshots`` (settings ``STORAGES``), under ``blobs/<owner id>/``: the "missing"
answer is about the asking person's own contents only, never anyone else's.

Every cap is checked on what is declared before a byte is stored: the lab's cap on one
snapshot (bytes and files), the site's cap on what one person keeps in all
(``PORTAL_SNAPSHOT_PERSON_MAX_MB``); an upload is counted as it streams, cut off past
its declared size and hashed, and nothing of a refused upload stays.

The canonical manifest, whose sha256 is a snapshot's digest: the files sorted by path
(as UTF-8 bytes), as compact JSON ``[[path, size, mode, sha256], ...]`` (``mode`` a
number, 420 or 493), UTF-8, no spaces.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import re
import tempfile
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.files import File
from django.core.files.storage import storages
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q, Sum
from django.http import Http404
from django.utils import timezone

from portal import audit
from portal.audit import AuditAction
from tpus.models import Job, Lab, Snapshot, SnapshotBlob, SnapshotFile
from tpus.models.jobs import ACTIVE_STATES, WAITING_STATES, JobState

log = logging.getLogger(__name__)

MODES = (0o644, 0o755)
MAX_FILE_BYTES = 2**40
MAX_PATH_BYTES = 1024
MAX_PART_BYTES = 255
CHUNK = 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")


class SnapshotRefused(Exception):
    """A manifest or an upload refused: ``detail`` for people, ``errors`` by field
    (``files``: one message per bad file; ``bytes``, ``count``: the caps), and for a
    snapshot whose contents are not all stored yet, the ``missing`` hashes. A refusal
    past a cap says it in numbers too (``caps``): ``bytes`` and ``cap_bytes`` (the
    lab's cap on one snapshot), ``files`` and ``cap_files``, or ``stored_bytes`` and
    ``person_cap_bytes`` (what one person may keep)."""

    def __init__(
        self,
        detail: str,
        errors: dict | None = None,
        missing: list | None = None,
        caps: dict | None = None,
    ):
        super().__init__(detail)
        self.detail = detail
        self.errors = errors or {}
        self.missing = missing
        self.caps = caps or {}


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    mode: int
    sha256: str


def storage():
    return storages["snapshots"]


def blob_name(owner_id: int, sha256: str) -> str:
    """Where one person's content lies in the storage."""
    return f"blobs/{int(owner_id)}/{sha256[:2]}/{sha256}"


def size_text(size: int) -> str:
    """``1.3 GB``, ``512 MB``, ``12 KB``, ``7 bytes`` (binary units)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{size} byte{'s' if size != 1 else ''}"


def lab_cap_bytes(lab: Lab) -> int:
    return lab.snapshot_max_mb * 2**20


def person_cap_bytes() -> int:
    return settings.PORTAL_SNAPSHOT_PERSON_MAX_MB * 2**20


def stored_bytes(user) -> int:
    """What the person keeps stored now, across every lab."""
    return SnapshotBlob.objects.filter(owner=user).aggregate(n=Sum("size"))["n"] or 0


# --- the manifest --------------------------------------------------------------------


def path_problem(path) -> str:
    """Why ``path`` cannot be a file of a snapshot ('' when it can): relative, parts
    neither empty nor ``.``/``..``, no control character, not too long."""
    if not isinstance(path, str):
        return "the path is not text"
    if not path:
        return "the path is empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "the path has a control character (NUL, newline, tab …)"
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        return "the path is not valid UTF-8"
    if path.startswith("/"):
        return "the path is absolute; paths are relative to the job's folder"
    if len(raw) > MAX_PATH_BYTES:
        return f"the path is longer than {MAX_PATH_BYTES} bytes"
    for part in path.split("/"):
        if not part:
            return "the path has an empty part (// or a / at either end)"
        if part in (".", ".."):
            return f"the path has a '{part}' part; only plain names are allowed"
        if len(part.encode()) > MAX_PART_BYTES:
            return f"a part of the path is longer than {MAX_PART_BYTES} bytes"
    return ""


def check_manifest(lab: Lab, files) -> list[FileEntry]:
    """The files of a manifest, checked (each path, mode, size and hash, no path twice,
    none both a file and a folder, within the lab's caps), sorted as the canonical
    manifest has them; SnapshotRefused naming every problem."""
    if not isinstance(files, list) or not files:
        raise SnapshotRefused("Send the workdir's files: a non-empty list.", {"files": ["empty"]})
    problems: list[str] = []
    entries: list[FileEntry] = []
    seen: set[str] = set()
    sizes: dict[str, int] = {}
    for number, item in enumerate(files):
        if not isinstance(item, dict):
            problems.append(f"file {number}: give path, size, mode and sha256")
            continue
        path = item.get("path")
        where = f"{path!r}" if isinstance(path, str) and len(path) < 300 else f"file {number}"
        problem = path_problem(path)
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        size, mode, sha = item.get("size"), item.get("mode"), item.get("sha256")
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            problems.append(f"{where}: the size is a whole number of bytes from 0 to 2^40")
            continue
        if type(mode) is not int or mode not in MODES:
            problems.append(f"{where}: the mode is 420 (0644) or 493 (0755), not {mode!r}")
            continue
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            problems.append(f"{where}: the sha256 is 64 lowercase hex digits")
            continue
        if path in seen:
            problems.append(f"{where}: the path is listed twice")
            continue
        if sizes.setdefault(sha, size) != size:
            problems.append(f"{where}: the same sha256 is given another size elsewhere")
            continue
        seen.add(path)
        entries.append(FileEntry(path, size, mode, sha))
    for entry in entries:
        parts = entry.path.split("/")
        for end in range(1, len(parts)):
            folder = "/".join(parts[:end])
            if folder in seen:
                problems.append(
                    f"{folder!r}: the path is both a file and a folder (of {entry.path!r})"
                )
                break
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise SnapshotRefused(f"The manifest is refused: {shown}.", {"files": problems})
    total = sum(e.size for e in entries)
    if len(entries) > lab.snapshot_max_files:
        raise SnapshotRefused(
            f"The workdir has {len(entries):,} files; the lab's cap is "
            f"{lab.snapshot_max_files:,} file{'s' if lab.snapshot_max_files != 1 else ''}.",
            {"count": [f"{len(entries)} > {lab.snapshot_max_files}"]},
            caps={"files": len(entries), "cap_files": lab.snapshot_max_files},
        )
    if total > lab_cap_bytes(lab):
        raise SnapshotRefused(
            f"The workdir is {size_text(total)}; the lab's cap is {size_text(lab_cap_bytes(lab))}.",
            {"bytes": [f"{total} > {lab_cap_bytes(lab)}"]},
            caps={"bytes": total, "cap_bytes": lab_cap_bytes(lab)},
        )
    return sorted(entries, key=lambda e: e.path.encode())


def digest_of(entries: list[FileEntry]) -> str:
    """sha256 of the canonical manifest (see the module's text)."""
    rows = [
        [e.path, e.size, e.mode, e.sha256] for e in sorted(entries, key=lambda e: e.path.encode())
    ]
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _unique_sizes(entries: list[FileEntry]) -> dict[str, int]:
    return {e.sha256: e.size for e in entries}


def _check_person_cap(user, more: int) -> None:
    kept = stored_bytes(user)
    if more and kept + more > person_cap_bytes():
        raise SnapshotRefused(
            f"Storing it needs {size_text(more)} more; you keep {size_text(kept)} of "
            f"snapshots and may keep {size_text(person_cap_bytes())} in all. Remove old "
            "snapshots or wait for them to expire.",
            {"bytes": [f"{kept} + {more} > {person_cap_bytes()}"]},
            caps={"stored_bytes": kept, "bytes": more, "person_cap_bytes": person_cap_bytes()},
        )


def missing(user, lab: Lab, files) -> dict:
    """Which of the manifest's contents the person has not stored yet (theirs only),
    with the workdir's total size and the lab's cap; SnapshotRefused for a bad
    manifest or one past a cap."""
    entries = check_manifest(lab, files)
    sizes = _unique_sizes(entries)
    have = set(
        SnapshotBlob.objects.filter(owner=user, sha256__in=list(sizes)).values_list(
            "sha256", flat=True
        )
    )
    lacking = sorted(sha for sha in sizes if sha not in have)
    _check_person_cap(user, sum(sizes[sha] for sha in lacking))
    return {
        "missing": lacking,
        "bytes": sum(e.size for e in entries),
        "cap_bytes": lab_cap_bytes(lab),
    }


# --- contents ------------------------------------------------------------------------


def _declared(declared) -> int:
    try:
        size = int(declared)
    except (TypeError, ValueError):
        raise SnapshotRefused("Send the content's length (Content-Length).") from None
    if size < 0:
        raise SnapshotRefused("Send the content's length (Content-Length).")
    return size


def _check_lab_cap(lab: Lab, size: int, what: str) -> None:
    if size > lab_cap_bytes(lab):
        raise SnapshotRefused(
            f"{what} is {size_text(size)}; the lab's cap on a workdir is "
            f"{size_text(lab_cap_bytes(lab))}.",
            {"bytes": [f"{size} > {lab_cap_bytes(lab)}"]},
            caps={"bytes": size, "cap_bytes": lab_cap_bytes(lab)},
        )


def _receive(body, size: int, sha256: str, spool) -> None:
    """``size`` bytes of ``body`` into ``spool``, hashed as they stream; refused when
    the body ends early or they are not the content named ``sha256``."""
    digest = hashlib.sha256()
    count = 0
    while count < size:
        chunk = body.read(min(CHUNK, size - count))
        if not chunk:
            break
        count += len(chunk)
        digest.update(chunk)
        spool.write(chunk)
    if count != size:
        raise SnapshotRefused(
            f"The body ended after {count:,} of the {size:,} bytes declared; nothing was stored."
        )
    if digest.hexdigest() != sha256:
        raise SnapshotRefused(
            f"The content's sha256 is {digest.hexdigest()}, not {sha256}; nothing was stored."
        )


def _keep(user, received: list[tuple[str, int, object]]) -> list[tuple[SnapshotBlob, bool]]:
    """The received contents (sha256, size, spooled file) stored as the person's, the
    person's cap checked again for their sum with the person's row locked (one
    person's uploads one after another here); nothing stays when it is refused."""
    store = storage()
    written = []
    for sha256, _, spool in received:
        spool.seek(0)
        name = blob_name(user.pk, sha256)
        if not store.exists(name):
            saved = store.save(name, File(spool))
            if saved != name:  # stored meanwhile by a request alike
                store.delete(saved)
            written.append(sha256)
    with transaction.atomic():
        get_user_model().objects.select_for_update().filter(pk=user.pk).exists()
        have = dict(
            SnapshotBlob.objects.filter(
                owner=user, sha256__in=[sha for sha, _, _ in received]
            ).values_list("sha256", "pk")
        )
        try:
            _check_person_cap(user, sum(size for sha, size, _ in received if sha not in have))
        except SnapshotRefused:
            for sha256 in written:
                if sha256 not in have:
                    store.delete(blob_name(user.pk, sha256))
            raise
        kept = []
        for sha256, size, _ in received:
            if sha256 in have:
                kept.append((SnapshotBlob.objects.get(pk=have[sha256]), False))
                continue
            try:
                with transaction.atomic():
                    blob = SnapshotBlob.objects.create(owner=user, sha256=sha256, size=size)
                kept.append((blob, True))
            except IntegrityError:
                kept.append((SnapshotBlob.objects.get(owner=user, sha256=sha256), False))
    return kept


def store_blob(user, lab: Lab, sha256: str, body, declared) -> tuple[SnapshotBlob, bool]:
    """Store one content from ``body`` (a stream), ``declared`` bytes long (the
    request's Content-Length): refused before reading when the declared size is
    missing or past a cap, cut off past it, hashed as it streams; stored only when
    all of it matches. (blob, True when newly stored)."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise SnapshotRefused("A content's name is its sha256: 64 lowercase hex digits.")
    existing = SnapshotBlob.objects.filter(owner=user, sha256=sha256).first()
    if existing is not None:
        return existing, False
    size = _declared(declared)
    _check_lab_cap(lab, size, "The file")
    _check_person_cap(user, size)
    with tempfile.TemporaryFile() as spool:
        _receive(body, size, sha256, spool)
        if body.read(1):
            raise SnapshotRefused(
                f"The body is longer than the {size:,} bytes declared; nothing was stored."
            )
        [kept] = _keep(user, [(sha256, size, spool)])
    return kept


BUNDLE_MAX_CONTENTS = 10_000


def store_bundle(user, lab: Lab, body, declared) -> dict:
    """Store many contents sent in one body (``declared`` bytes, the Content-Length),
    each as ``<sha256> <size>\\n`` then its bytes, one after another (small files in
    one request, not one each). Refused before reading past a cap; each content hashed
    as it streams; all are stored or none. Those the person had stored already are
    read and left as they were. ``{"stored": n, "had": n, "bytes": n}``."""
    total = _declared(declared)
    _check_lab_cap(lab, total, "The upload")
    _check_person_cap(user, total)
    received: list[tuple[str, int, object]] = []
    seen: set[str] = set()
    count = 0
    try:
        while count < total:
            head = body.readline(100)
            count += len(head)
            sha256, _, size_text_ = head.decode("ascii", "replace").rstrip("\n").partition(" ")
            if (
                not head.endswith(b"\n")
                or not _SHA256.fullmatch(sha256)
                or not (size_text_.isdigit() and len(size_text_) <= 13)
            ):
                raise SnapshotRefused(
                    f"Content {len(received) + 1} of the upload has no header "
                    "(<sha256> <size> and a newline); nothing was stored."
                )
            size = int(size_text_)
            where = f"Content {len(received) + 1} of the upload ({sha256})"
            if count + size > total:
                raise SnapshotRefused(
                    f"{where} ends past the {total:,} bytes declared; nothing was stored."
                )
            if sha256 in seen or len(seen) >= BUNDLE_MAX_CONTENTS:
                raise SnapshotRefused(
                    f"{where} comes twice, or is more than {BUNDLE_MAX_CONTENTS:,} in one "
                    "upload; nothing was stored."
                )
            seen.add(sha256)
            spool = tempfile.TemporaryFile()
            received.append((sha256, size, spool))
            _receive(body, size, sha256, spool)
            count += size
        if body.read(1):
            raise SnapshotRefused(
                f"The body is longer than the {total:,} bytes declared; nothing was stored."
            )
        kept = _keep(user, received)
    finally:
        for _, _, spool in received:
            spool.close()
    return {
        "stored": sum(1 for _, made in kept if made),
        "had": sum(1 for _, made in kept if not made),
        "bytes": total,
    }


def open_blob(owner_id: int, sha256: str):
    """One of the person's contents, open for reading (a stream, not in memory)."""
    return storage().open(blob_name(owner_id, sha256), "rb")


# --- snapshots -----------------------------------------------------------------------


def _expiry(now: dt.datetime) -> dt.datetime:
    return now + dt.timedelta(days=settings.PORTAL_SNAPSHOT_KEEP_DAYS)


def create_snapshot(user, lab: Lab, files) -> tuple[Snapshot, bool]:
    """The snapshot of the manifest, made once every content of it is stored (the same
    manifest again by the same person in the lab: the one made before, kept longer).
    (snapshot, True when made now)."""
    entries = check_manifest(lab, files)
    sizes = _unique_sizes(entries)
    stored = dict(
        SnapshotBlob.objects.filter(owner=user, sha256__in=list(sizes)).values_list(
            "sha256", "size"
        )
    )
    lacking = sorted(sha for sha in sizes if sha not in stored)
    if lacking:
        raise SnapshotRefused(
            f"{len(lacking)} of the workdir's contents are not stored yet; upload them first.",
            missing=lacking,
        )
    wrong = sorted(sha for sha, size in sizes.items() if stored[sha] != size)
    if wrong:
        raise SnapshotRefused(
            f"{len(wrong)} file(s) are declared with another size than their stored content.",
            {"files": [f"{sha}: stored as {stored[sha]} bytes" for sha in wrong]},
        )
    digest = digest_of(entries)
    now = timezone.now()
    with transaction.atomic():
        found = Snapshot.objects.select_for_update().filter(lab=lab, owner=user, digest=digest)
        snapshot = found.first()
        if snapshot is not None:
            snapshot.last_needed_at = now
            snapshot.expires_at = _expiry(now)
            snapshot.save(update_fields=["last_needed_at", "expires_at"])
            return snapshot, False
        snapshot = Snapshot.objects.create(
            lab=lab,
            owner=user,
            digest=digest,
            file_count=len(entries),
            total_bytes=sum(e.size for e in entries),
            created_at=now,
            last_needed_at=now,
            expires_at=_expiry(now),
        )
        SnapshotFile.objects.bulk_create(
            (
                SnapshotFile(
                    snapshot=snapshot, path=e.path, size=e.size, mode=e.mode, sha256=e.sha256
                )
                for e in entries
            ),
            batch_size=1000,
        )
    return snapshot, True


def get_own_snapshot(user, lab: Lab, snapshot_id) -> Snapshot:
    """The person's own snapshot in the lab; anyone else's, or another lab's, is a 404
    like one that does not exist."""
    try:
        return Snapshot.objects.get(pk=int(snapshot_id), owner=user, lab=lab)
    except (Snapshot.DoesNotExist, TypeError, ValueError):
        raise Http404("No such snapshot.") from None


def needed(snapshot_id: int | None) -> None:
    """A job needs the snapshot now (submitted, placed, started): kept longer."""
    if snapshot_id is None:
        return
    now = timezone.now()
    Snapshot.objects.filter(pk=snapshot_id).update(last_needed_at=now, expires_at=_expiry(now))


def files_of(snapshot: Snapshot) -> list[FileEntry]:
    return [
        FileEntry(path, size, mode, sha)
        for path, size, mode, sha in snapshot.files.order_by("path").values_list(
            "path", "size", "mode", "sha256"
        )
    ]


# --- expiry --------------------------------------------------------------------------


def _needing_jobs() -> Q:
    """Jobs that still need their snapshot: waiting, placed or running, or lost with
    their VM and to be run again (not yet)."""
    return Q(state__in=[*WAITING_STATES, *ACTIVE_STATES]) | Q(
        state=JobState.LOST, rerun_after_preemption=True, reruns__isnull=True
    )


def expire_snapshots(now: dt.datetime | None = None) -> int:
    """Remove the snapshots past their expiry that no job needs, then the contents no
    snapshot of their owner names (once past the grace an upload has to be named);
    each removal is in the lab's audit trail. The number of snapshots removed."""
    now = now or timezone.now()
    needed_ids = Job.objects.filter(_needing_jobs(), snapshot__isnull=False).values("snapshot_id")
    due = Snapshot.objects.filter(expires_at__lt=now).exclude(pk__in=needed_ids)
    removed = 0
    for snapshot in due.select_related("lab", "owner"):
        removed += _remove(snapshot, "expired: no job needed it for "
                           f"{settings.PORTAL_SNAPSHOT_KEEP_DAYS} days")  # fmt: skip
    remove_unnamed_blobs(now - dt.timedelta(hours=settings.PORTAL_SNAPSHOT_BLOB_GRACE_HOURS))
    return removed


def _remove(snapshot: Snapshot, why: str, *, actor=None) -> int:
    with transaction.atomic():
        deleted, _ = Snapshot.objects.filter(pk=snapshot.pk).delete()
        if not deleted:
            return 0
        audit.record(
            AuditAction.SNAPSHOT_REMOVED,
            actor=actor,
            lab=snapshot.lab,
            target_user=snapshot.owner,
            summary=f"snapshot {snapshot.pk} ({snapshot.digest[:12]}, {snapshot.file_count} "
            f"files, {size_text(snapshot.total_bytes)}): {why}",
            data={"snapshot": snapshot.pk, "digest": snapshot.digest},
        )
    return 1


def remove_unnamed_blobs(older_than: dt.datetime | None = None, *, owner=None) -> int:
    """Remove the contents no snapshot of their owner names (those stored before
    ``older_than``; all of ``owner``'s with it None). The number removed."""
    blobs = SnapshotBlob.objects.all()
    if owner is not None:
        blobs = blobs.filter(owner=owner)
    if older_than is not None:
        blobs = blobs.filter(created_at__lt=older_than)
    named = SnapshotFile.objects.filter(
        snapshot__owner_id=OuterRef("owner_id"), sha256=OuterRef("sha256")
    )
    blobs = blobs.exclude(Exists(named))
    count = 0
    store = storage()
    for blob in blobs.only("pk", "owner_id", "sha256"):
        with transaction.atomic():
            if not SnapshotBlob.objects.filter(pk=blob.pk).delete()[0]:
                continue
            store.delete(blob_name(blob.owner_id, blob.sha256))
        count += 1
    return count


def remove_snapshots_of(user, lab: Lab, why: str, *, actor=None) -> int:
    """Everything the person stored in the lab goes (they left it, or were removed):
    the snapshots, then the contents no other snapshot of theirs names."""
    removed = 0
    for snapshot in Snapshot.objects.filter(owner=user, lab=lab).select_related("lab", "owner"):
        removed += _remove(snapshot, why, actor=actor)
    remove_unnamed_blobs(owner=user)
    return removed


def person_deleted(sender, instance, **kwargs) -> None:
    """A person deleted, from the admin or anywhere else, takes their stored workdir
    contents with them: the files in the storage too, which no database cascade
    reaches (connected to the user model's ``pre_delete`` in ``tpus.apps``)."""
    forget_person(instance)


def forget_person(user) -> int:
    """A person being deleted: every content they stored goes from the storage (their
    rows go with them). The number of contents removed."""
    Snapshot.objects.filter(owner=user).delete()
    return remove_unnamed_blobs(owner=user)

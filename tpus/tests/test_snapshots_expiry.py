"""Workdir snapshots expire: beat removes those past their expiry that no job needs
(waiting, placed, running, or lost and to be run again), then the contents no snapshot
of their owner names, each removal in the lab's audit log; a person removed from a lab
loses what they stored there, and a person deleted loses every stored content."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
from pathlib import Path

import pytest
from django.db.models import ProtectedError
from django.utils import timezone

from portal.celery import app
from tpus.models import AuditEvent, Grant, Membership, Snapshot, SnapshotBlob
from tpus.services import labs as lab_services
from tpus.services import snapshots
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


@pytest.fixture(autouse=True)
def _storage(settings, tmp_path) -> Path:
    root = tmp_path / "snapshots"
    settings.STORAGES = {
        **settings.STORAGES,
        "snapshots": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(root)},
        },
    }
    return root


def _stored(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _snapshot(user, lab, content: bytes, *, days_ago: int = 10) -> Snapshot:
    sha = hashlib.sha256(content).hexdigest()
    snapshots.store_blob(user, lab, sha, io.BytesIO(content), len(content))
    files = [{"path": "a.py", "size": len(content), "mode": 0o644, "sha256": sha}]
    snapshot, _ = snapshots.create_snapshot(user, lab, files)
    past = timezone.now() - dt.timedelta(days=days_ago)
    Snapshot.objects.filter(pk=snapshot.pk).update(
        last_needed_at=past, expires_at=past + dt.timedelta(days=7)
    )
    SnapshotBlob.objects.filter(owner=user, sha256=sha).update(created_at=past)
    snapshot.refresh_from_db()
    return snapshot


def test_beat_runs_the_expiry():
    assert "tpus.tasks.expire_snapshots" in {
        entry["task"] for entry in app.conf.beat_schedule.values()
    }


def test_an_expired_snapshot_no_job_needs_goes_with_its_contents(scene, _storage):
    old = _snapshot(scene.milo, scene.lab, b"old\n")
    ended = make_job(scene.vm, scene.milo, "succeeded", snapshot=old, snapshot_digest=old.digest)
    fresh = _snapshot(scene.milo, scene.lab, b"fresh\n", days_ago=1)
    assert _stored(_storage) == 2
    assert snapshots.expire_snapshots() == 1
    assert list(Snapshot.objects.all()) == [fresh]
    assert list(SnapshotBlob.objects.values_list("sha256", flat=True)) == [
        hashlib.sha256(b"fresh\n").hexdigest()
    ]
    assert _stored(_storage) == 1
    ended.refresh_from_db()
    assert ended.snapshot_id is None and ended.snapshot_digest == old.digest
    [event] = AuditEvent.objects.filter(action="snapshot.removed")
    assert event.lab == scene.lab and event.target_user == scene.milo and event.actor is None
    assert "expired" in event.summary and old.digest[:12] in event.summary


@pytest.mark.parametrize(
    "state, fields",
    [
        ("queued", {}),
        ("running", {}),
        ("lost", {"rerun_after_preemption": True}),
    ],
)
def test_a_snapshot_a_job_still_needs_stays_past_its_expiry(scene, _storage, state, fields):
    kept = _snapshot(scene.milo, scene.lab, b"kept\n")
    make_job(scene.vm, scene.milo, state, snapshot=kept, snapshot_digest=kept.digest, **fields)
    assert snapshots.expire_snapshots() == 0
    assert Snapshot.objects.get() == kept and _stored(_storage) == 1


def test_a_lost_job_already_run_again_no_longer_holds_its_snapshot(scene):
    snapshot = _snapshot(scene.milo, scene.lab, b"moved\n")
    lost = make_job(
        scene.vm, scene.milo, "lost", snapshot=snapshot, snapshot_digest=snapshot.digest,
        rerun_after_preemption=True,
    )  # fmt: skip
    make_job(scene.vm, scene.milo, "succeeded", rerun_of=lost, snapshot=snapshot)
    assert snapshots.expire_snapshots() == 1


def test_a_content_being_uploaded_stays_until_its_snapshot_is_made(scene, _storage):
    content = b"uploading\n"
    sha = hashlib.sha256(content).hexdigest()
    snapshots.store_blob(scene.milo, scene.lab, sha, io.BytesIO(content), len(content))
    snapshots.expire_snapshots()
    assert SnapshotBlob.objects.filter(sha256=sha).exists() and _stored(_storage) == 1


def test_a_content_another_snapshot_of_its_owner_names_stays(scene, _storage):
    shared = b"shared\n"
    old = _snapshot(scene.milo, scene.lab, shared)
    sha = hashlib.sha256(shared).hexdigest()
    files = [
        {"path": "b.py", "size": len(shared), "mode": 0o644, "sha256": sha},
    ]
    newer, _ = snapshots.create_snapshot(scene.milo, scene.lab, files)
    assert snapshots.expire_snapshots() == 1
    assert list(Snapshot.objects.all()) == [newer] and old.pk != newer.pk
    assert SnapshotBlob.objects.filter(sha256=sha).exists() and _stored(_storage) == 1


def test_a_person_removed_from_the_lab_loses_what_they_stored_there(scene, _storage):
    _snapshot(scene.milo, scene.lab, b"milo\n", days_ago=0)
    _snapshot(scene.ann, scene.lab, b"ann\n", days_ago=0)
    membership = Membership.objects.get(lab=scene.lab, user=scene.milo)
    lab_services.remove_member(scene.admin, membership)
    assert list(Snapshot.objects.values_list("owner", flat=True)) == [scene.ann.pk]
    assert not SnapshotBlob.objects.filter(owner=scene.milo).exists()
    assert _stored(_storage) == 1
    [event] = AuditEvent.objects.filter(action="snapshot.removed")
    assert event.actor == scene.admin and "removed from the lab" in event.summary


def test_a_person_deleted_takes_their_stored_contents_with_them(scene, _storage):
    _snapshot(scene.milo, scene.lab, b"gone\n", days_ago=0)
    _snapshot(scene.ann, scene.lab, b"stays\n", days_ago=0)
    assert snapshots.forget_person(scene.milo) == 1
    assert _stored(_storage) == 1 and not SnapshotBlob.objects.filter(owner=scene.milo).exists()


def test_deleting_a_person_anywhere_removes_their_stored_files(scene, _storage):
    _snapshot(scene.milo, scene.lab, b"gone with milo\n", days_ago=0)
    _snapshot(scene.ann, scene.lab, b"stays\n", days_ago=0)
    assert _stored(_storage) == 2
    # Refused while rows protect the person: nothing is lost.
    with pytest.raises(ProtectedError):
        type(scene.milo).objects.filter(pk=scene.milo.pk).delete()
    assert _stored(_storage) == 2
    Grant.objects.filter(user=scene.milo).delete()
    type(scene.milo).objects.filter(pk=scene.milo.pk).delete()
    assert _stored(_storage) == 1
    assert not SnapshotBlob.objects.filter(owner_id=scene.milo.pk).exists()

"""Workdir snapshots through the API: which contents are missing (the asker's own
only), uploads checked against the caps before a byte is stored and hashed as they
stream, snapshots made from stored contents, and jobs that carry one (their owner's,
in their lab, only)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from accounts.services import create_token
from tpus.models import Job, Snapshot, SnapshotBlob
from tpus.services import jobs as job_services
from tpus.services import snapshots
from tpus.tests import jobs_support

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


@pytest.fixture(autouse=True)
def _storage(settings, tmp_path) -> Path:
    root = tmp_path / "snapshots"
    settings.STORAGES = {
        **settings.STORAGES,
        "snapshots": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {
                "location": str(root),
                "file_permissions_mode": 0o600,
                "directory_permissions_mode": 0o700,
            },
        },
    }
    return root


def _auth(user) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}


def _url(lab, tail: str = "") -> str:
    return f"/api/v1/labs/{lab.slug}/snapshots{tail}"


def _file(path: str, content: bytes, mode: int = 0o644) -> dict:
    return {
        "path": path,
        "size": len(content),
        "mode": mode,
        "sha256": hashlib.sha256(content).hexdigest(),
    }


def _missing(client, lab, user, files):
    return client.post(
        _url(lab, "/missing"), {"files": files}, content_type="application/json", **_auth(user)
    )


def _put(client, lab, user, content: bytes, sha: str | None = None, **extra):
    sha = sha or hashlib.sha256(content).hexdigest()
    return client.put(
        _url(lab, f"/blobs/{sha}"),
        content,
        content_type="application/octet-stream",
        **_auth(user),
        **extra,
    )


def _create(client, lab, user, files):
    return client.post(_url(lab), {"files": files}, content_type="application/json", **_auth(user))


def _stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


A, B = b"print('a')\n", b"#!/bin/sh\necho b\n"
FILES = [_file("src/a.py", A), _file("run.sh", B, 0o755)]


def test_a_workdir_is_uploaded_once_and_its_snapshot_named_by_its_manifest(client, scene, _storage):
    lab, milo = scene.lab, scene.milo
    first = _missing(client, lab, milo, FILES)
    assert first.status_code == 200, first.content
    assert sorted(first.json()["missing"]) == sorted(f["sha256"] for f in FILES)
    assert first.json()["bytes"] == len(A) + len(B)
    assert first.json()["cap_bytes"] == 1024 * 2**20
    assert _put(client, lab, milo, A).status_code == 201
    again = _put(client, lab, milo, A)
    assert again.status_code == 200 and again.json() == {
        "sha256": FILES[0]["sha256"],
        "size": len(A),
    }
    assert _missing(client, lab, milo, FILES).json()["missing"] == [FILES[1]["sha256"]]
    refused = _create(client, lab, milo, FILES)
    assert refused.status_code == 400 and refused.json()["missing"] == [FILES[1]["sha256"]]
    assert _put(client, lab, milo, B).status_code == 201
    made = _create(client, lab, milo, FILES)
    assert made.status_code == 201, made.content
    body = made.json()
    entries = [snapshots.FileEntry(f["path"], f["size"], f["mode"], f["sha256"]) for f in FILES]
    assert body["digest"] == snapshots.digest_of(entries)
    assert body["files"] == 2 and body["bytes"] == len(A) + len(B) and body["expires_at"]
    same = _create(client, lab, milo, list(reversed(FILES)))
    assert same.status_code == 200 and same.json()["id"] == body["id"]
    # Stored by content, readable by the portal only.
    stored = _stored_files(_storage)
    assert len(stored) == 2 and all(p.stat().st_mode & 0o777 == 0o600 for p in stored)
    assert _storage.stat().st_mode & 0o777 == 0o700


def test_the_missing_answer_is_about_the_askers_own_contents_only(client, scene):
    lab = scene.lab
    assert _put(client, lab, scene.ann, A).status_code == 201
    # Ann has it; milo is told it is missing all the same, and must send it himself.
    assert _missing(client, lab, scene.milo, FILES[:1]).json()["missing"] == [FILES[0]["sha256"]]
    assert _create(client, lab, scene.milo, FILES[:1]).status_code == 400
    assert _put(client, lab, scene.milo, A).status_code == 201
    assert SnapshotBlob.objects.filter(sha256=FILES[0]["sha256"]).count() == 2


@pytest.mark.parametrize(
    "entry, fragment",
    [
        ({"path": "/etc/passwd"}, "absolute"),
        ({"path": "../outside.py"}, "'..' part"),
        ({"path": "src/../../x"}, "'..' part"),
        ({"path": "./a.py"}, "'.' part"),
        ({"path": "src//a.py"}, "empty part"),
        ({"path": "src/"}, "empty part"),
        ({"path": ""}, "empty"),
        ({"path": "a\0b"}, "control character"),
        ({"path": "a\nb"}, "control character"),
        ({"path": "x" * 1100}, "longer than 1024 bytes"),
        ({"path": "d/" + "y" * 256}, "longer than 255 bytes"),
        ({"path": 7}, "not text"),
        ({"mode": 0o777}, "mode is 420 (0644) or 493 (0755)"),
        ({"mode": "420"}, "mode is 420"),
        ({"size": -1}, "size is a whole number"),
        ({"size": True}, "size is a whole number"),
        ({"sha256": "ABC"}, "64 lowercase hex"),
    ],
)
def test_a_bad_file_in_the_manifest_is_refused_with_what_is_wrong(client, scene, entry, fragment):
    bad = {**_file("ok.py", A), **entry}
    response = _missing(client, scene.lab, scene.milo, [bad])
    assert response.status_code == 400, response.content
    assert fragment in response.json()["detail"]
    assert fragment in response.json()["errors"]["files"][0]


def test_a_path_listed_twice_or_both_a_file_and_a_folder_is_refused(client, scene):
    twice = _missing(client, scene.lab, scene.milo, [_file("a.py", A), _file("a.py", B)])
    assert twice.status_code == 400 and "listed twice" in twice.json()["detail"]
    both = _missing(client, scene.lab, scene.milo, [_file("src", A), _file("src/b.py", B)])
    assert both.status_code == 400 and "both a file and a folder" in both.json()["detail"]
    empty = _missing(client, scene.lab, scene.milo, [])
    assert empty.status_code == 400


def test_the_labs_caps_refuse_a_workdir_before_anything_is_stored(client, scene, _storage):
    lab = scene.lab
    lab.snapshot_max_mb = 1
    lab.snapshot_max_files = 2
    lab.save()
    big = {"path": "data.bin", "size": 1363149, "mode": 0o644, "sha256": "a" * 64}
    response = _missing(client, lab, scene.milo, [big])
    assert response.status_code == 400
    assert response.json()["detail"] == "The workdir is 1.3 MB; the lab's cap is 1 MB."
    # The numbers too, for a client to say in its own words.
    assert (response.json()["bytes"], response.json()["cap_bytes"]) == (1363149, 2**20)
    many = [_file(f"f{i}.py", bytes([i])) for i in range(3)]
    response = _missing(client, lab, scene.milo, many)
    assert response.status_code == 400
    assert response.json()["detail"] == "The workdir has 3 files; the lab's cap is 2 files."
    assert (response.json()["files"], response.json()["cap_files"]) == (3, 2)
    # An upload past the lab's cap is refused on its declared length.
    content = b"x" * (2**20 + 1)
    response = _put(client, lab, scene.milo, content)
    assert (
        response.status_code == 400
        and "the lab's cap on a workdir is 1 MB" in response.json()["detail"]
    )
    assert response.json()["cap_bytes"] == 2**20
    assert _stored_files(_storage) == [] and not SnapshotBlob.objects.exists()


def test_the_persons_cap_across_their_snapshots_is_kept(client, scene, settings, _storage):
    settings.PORTAL_SNAPSHOT_PERSON_MAX_MB = 1
    first = b"1" * (700 * 1024)
    second = b"2" * (400 * 1024)
    assert _put(client, scene.lab, scene.milo, first).status_code == 201
    refused = _missing(client, scene.lab, scene.milo, [_file("b.bin", second)])
    assert refused.status_code == 400
    assert "you keep 700 KB of snapshots and may keep 1 MB in all" in refused.json()["detail"]
    said = refused.json()
    assert (said["stored_bytes"], said["bytes"], said["person_cap_bytes"]) == (
        700 * 1024,
        400 * 1024,
        2**20,
    )
    assert said["cap_bytes"] is None  # not the lab's cap that refused it
    assert _put(client, scene.lab, scene.milo, second).status_code == 400
    assert len(_stored_files(_storage)) == 1
    # Ann's own cap is hers.
    assert _put(client, scene.lab, scene.ann, second).status_code == 201


def test_a_failed_upload_leaves_nothing(client, scene, _storage):
    lab, milo = scene.lab, scene.milo
    wrong = _put(client, lab, milo, A, sha="b" * 64)
    assert wrong.status_code == 400 and "sha256 is" in wrong.json()["detail"]
    # A stream shorter than declared, or longer (cut off past the declared size).
    sha = hashlib.sha256(A).hexdigest()
    with pytest.raises(snapshots.SnapshotRefused, match="ended after"):
        snapshots.store_blob(milo, lab, sha, io.BytesIO(A), len(A) + 50)
    with pytest.raises(snapshots.SnapshotRefused, match="longer than the 11 bytes declared"):
        snapshots.store_blob(milo, lab, sha, io.BytesIO(A + b"more" * 1000), len(A))
    undeclared = _put(client, lab, milo, A, CONTENT_LENGTH="")
    assert undeclared.status_code == 400 and "Content-Length" in undeclared.json()["detail"]
    bad_name = _put(client, lab, milo, A, sha="not-a-hash")
    assert bad_name.status_code == 400
    assert _stored_files(_storage) == [] and not SnapshotBlob.objects.exists()


def test_a_lab_you_are_not_in_has_no_snapshots_for_you(client, scene, make_user):
    stranger = make_user("eve@elsewhere.example")
    assert _missing(client, scene.lab, stranger, FILES).status_code == 404
    assert _put(client, scene.lab, stranger, A).status_code == 404
    assert _create(client, scene.lab, stranger, FILES).status_code == 404
    assert not SnapshotBlob.objects.exists()


def _snapshot_of(client, lab, user, files=FILES) -> int:
    for content in (A, B)[: len(files)]:
        _put(client, lab, user, content)
    response = _create(client, lab, user, files)
    assert response.status_code in (200, 201), response.content
    return response.json()["id"]


def test_a_job_carries_its_owners_snapshot_to_its_folder(client, scene):
    lab, milo = scene.lab, scene.milo
    snapshot_id = _snapshot_of(client, lab, milo)
    response = client.post(
        f"/api/v1/labs/{lab.slug}/jobs",
        {
            "accelerator_type": "v4-8",
            "args": ["sh", "run.sh"],
            "cwd": "~/proj",
            "snapshot": snapshot_id,
        },
        content_type="application/json",
        **_auth(milo),
    )
    assert response.status_code == 201, response.content
    body = response.json()
    snapshot = Snapshot.objects.get()
    assert body["cwd"] == "/home/milo/proj"
    assert body["snapshot"] == {
        "id": snapshot_id,
        "digest": snapshot.digest,
        "files": 2,
        "bytes": len(A) + len(B),
        "expires_at": body["snapshot"]["expires_at"],
    }
    # Without a folder: one of its own under the home.
    response = client.post(
        f"/api/v1/labs/{lab.slug}/vms/{scene.vm.pk}/jobs",
        {"args": ["sh", "run.sh"], "snapshot": snapshot_id},
        content_type="application/json",
        **_auth(milo),
    )
    assert response.status_code == 201, response.content
    assert response.json()["cwd"] == f"/home/milo/tpu-snapshots/{snapshot.digest[:16]}"


def test_another_persons_or_another_labs_snapshot_is_not_found(client, scene, make_lab, add_member):
    lab = scene.lab
    anns = _snapshot_of(client, lab, scene.ann)
    other = make_lab("audio")
    add_member(other, scene.milo)
    milos_elsewhere = _snapshot_of(client, other, scene.milo)
    for snapshot_id in (anns, milos_elsewhere, 99999):
        for url in (
            f"/api/v1/labs/{lab.slug}/jobs",
            f"/api/v1/labs/{lab.slug}/jobs/validate",
            f"/api/v1/labs/{lab.slug}/vms/{scene.vm.pk}/jobs",
            f"/api/v1/labs/{lab.slug}/vms/{scene.vm.pk}/jobs/validate",
        ):
            response = client.post(
                url,
                {"accelerator_type": "v4-8", "args": ["true"], "snapshot": snapshot_id},
                content_type="application/json",
                **_auth(scene.milo),
            )
            assert response.status_code == 404, (url, response.content)
    assert not Job.objects.exists()


def test_a_rerun_keeps_its_snapshot_and_one_whose_snapshot_expired_is_refused(client, scene):
    snapshot_id = _snapshot_of(client, scene.lab, scene.milo)
    job = jobs_support.make_job(
        scene.vm, scene.milo, "succeeded", lab=scene.lab, snapshot_id=snapshot_id,
        snapshot_digest=Snapshot.objects.get().digest, cwd="/home/milo/proj",
    )  # fmt: skip
    again = job_services.rerun_job(scene.milo, job)
    assert again.snapshot_id == snapshot_id and again.cwd == "/home/milo/proj"
    Snapshot.objects.all().delete()
    job.refresh_from_db()
    with pytest.raises(Exception, match="has expired"):
        job_services.rerun_job(scene.milo, job)


def test_the_job_page_shows_the_workdir_it_carries(client, scene):
    from django.urls import reverse

    snapshot_id = _snapshot_of(client, scene.lab, scene.milo)
    snapshot = Snapshot.objects.get()
    pool = jobs_support.make_job(
        None, scene.milo, "queued", lab=scene.lab, accelerator_type="v4-8",
        snapshot_id=snapshot_id, snapshot_digest=snapshot.digest, cwd="/home/milo/proj",
    )  # fmt: skip
    placed = jobs_support.make_job(
        scene.vm, scene.milo, "running", lab=scene.lab, snapshot_id=snapshot_id,
        snapshot_digest=snapshot.digest, cwd="/home/milo/proj",
    )  # fmt: skip
    client.force_login(scene.milo)
    for url in (
        reverse("lab_job", args=[scene.lab.slug, pool.pk]),
        reverse("job_detail", args=[scene.lab.slug, scene.vm.pk, placed.pk]),
    ):
        page = client.get(url).content.decode()
        assert 'id="job-snapshot"' in page, url
        assert f"2 files, {len(A) + len(B)}\xa0bytes" in page and snapshot.digest[:16] in page
    Snapshot.objects.all().delete()
    page = client.get(reverse("job_detail", args=[scene.lab.slug, scene.vm.pk, placed.pk]))
    assert "its snapshot has expired" in page.content.decode()


def test_the_labs_admins_set_its_caps_on_a_snapshot(client, scene):
    url = f"/api/v1/labs/{scene.lab.slug}/settings"
    response = client.patch(
        url, {"snapshot_max_mb": 2, "snapshot_max_files": 1}, content_type="application/json",
        **_auth(scene.admin),
    )  # fmt: skip
    assert response.status_code == 200, response.content
    assert response.json()["snapshot_max_mb"] == 2 and response.json()["snapshot_max_files"] == 1
    refused = _missing(client, scene.lab, scene.milo, FILES)
    assert refused.json()["detail"] == "The workdir has 2 files; the lab's cap is 1 file."
    bad = client.patch(
        url, {"snapshot_max_files": 0}, content_type="application/json", **_auth(scene.admin)
    )
    assert bad.status_code == 400
    member = client.patch(
        url, {"snapshot_max_mb": 5000}, content_type="application/json", **_auth(scene.milo)
    )
    assert member.status_code == 403


def _bundle(client, lab, user, body: bytes, **extra):
    return client.post(
        _url(lab, "/blobs"), body, content_type="application/octet-stream", **_auth(user), **extra
    )


def _framed(*contents: bytes) -> bytes:
    return b"".join(f"{hashlib.sha256(c).hexdigest()} {len(c)}\n".encode() + c for c in contents)


def test_many_contents_go_in_one_upload_and_make_a_snapshot(client, scene, _storage):
    lab, milo = scene.lab, scene.milo
    assert _put(client, lab, milo, A).status_code == 201  # one stored before

    sent = _bundle(client, lab, milo, _framed(A, B, b""))

    assert sent.status_code == 200, sent.content
    assert sent.json() == {"stored": 2, "had": 1, "bytes": len(_framed(A, B, b""))}
    assert _missing(client, lab, milo, FILES).json()["missing"] == []
    assert _create(client, lab, milo, FILES).status_code == 201
    assert len(_stored_files(_storage)) == 3


@pytest.mark.parametrize(
    "body, words",
    [
        (_framed(A) + f"{'c' * 64} 3\nxyz".encode(), "sha256 is"),  # the second is wrong
        (_framed(A)[:-3], "ends past the"),  # cut short
        (b"not a header\n" + A, "has no header"),
        (_framed(A, A), "comes twice"),
    ],
)
def test_an_upload_of_many_with_one_wrong_stores_none(client, scene, _storage, body, words):
    refused = _bundle(client, scene.lab, scene.milo, body)

    assert refused.status_code == 400 and words in refused.json()["detail"], refused.content
    assert _stored_files(_storage) == [] and not SnapshotBlob.objects.exists()


def test_an_upload_of_many_past_the_labs_cap_is_refused_before_it_is_read(client, scene):
    scene.lab.snapshot_max_mb = 1
    scene.lab.save()
    body = _framed(b"x" * 700 * 1024, b"y" * 400 * 1024)

    refused = _bundle(client, scene.lab, scene.milo, body)

    assert refused.status_code == 400
    assert refused.json()["detail"].startswith("The upload is 1.1 MB; the lab's cap on a workdir")
    assert refused.json()["cap_bytes"] == 2**20 and not SnapshotBlob.objects.exists()
    stranger = _bundle(client, scene.lab, scene.ann, _framed(A))
    assert stranger.status_code == 200  # ann is a member: her own upload

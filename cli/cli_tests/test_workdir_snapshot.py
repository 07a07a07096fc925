"""`tpu run --type v4-8 --workdir DIR`: the workdir goes to the portal as a snapshot the
job names. The hashes come from a cache (one edit, one file read); the upload flow runs
against a small real HTTP server that keeps the snapshots contract (which contents it
lacks, the blobs, the snapshot, the job naming it), and refuses as the portal would."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cli_tests.test_run_checks_first import _run
from tpu_cli import errors, snapshot

FILES = {"train.py": "print('hi')\n", "model/net.py": "x = 1\n", "run.sh": "#!/bin/sh\n",
         "data/big.bin": "0" * 5000, ".gitignore": "data/\n*.pyc\n", "model/net.pyc": "c",
         ".git/HEAD": "ref"}  # fmt: skip


def build(root: Path, files: dict[str, str] = FILES) -> Path:
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    (root / "run.sh").chmod(0o755)
    return root


# --- the hash cache ---------------------------------------------------------------------


def test_a_run_after_one_edit_reads_that_file_alone(tmp_path):
    root = build(tmp_path / "proj")
    cache_file = tmp_path / "cache" / "hashes.json"

    first = snapshot.list_workdir(root, snapshot.HashCache(cache_file))
    again = snapshot.list_workdir(root, snapshot.HashCache(cache_file))
    (root / "model/net.py").write_text("x = 2\n")
    edited = snapshot.list_workdir(root, snapshot.HashCache(cache_file))

    assert (first.hashed, again.hashed, edited.hashed) == (4, 0, 1)
    by_path = {f["path"]: f for f in edited.files}
    assert sorted(by_path) == [".gitignore", "model/net.py", "run.sh", "train.py"]
    assert by_path["model/net.py"]["sha256"] == hashlib.sha256(b"x = 2\n").hexdigest()
    assert (by_path["run.sh"]["mode"], by_path["train.py"]["mode"]) == (0o755, 0o644)
    assert by_path["train.py"]["size"] == len(FILES["train.py"])
    assert first.files != edited.files


def test_a_file_replaced_by_another_of_the_same_size_and_time_is_read_again(tmp_path):
    root = build(tmp_path / "proj")
    cache_file = tmp_path / "hashes.json"
    snapshot.list_workdir(root, snapshot.HashCache(cache_file))
    stat = (root / "train.py").stat()
    replacement = root / "train.new"
    replacement.write_text("print('yo')\n")
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    replacement.replace(root / "train.py")  # a new inode, same size and mtime

    listed = snapshot.list_workdir(root, snapshot.HashCache(cache_file))

    assert listed.hashed == 1
    [train] = [f for f in listed.files if f["path"] == "train.py"]
    assert train["sha256"] == hashlib.sha256(b"print('yo')\n").hexdigest()


def test_a_broken_cache_file_means_hashing_again_not_failing(tmp_path):
    root = build(tmp_path / "proj")
    cache_file = tmp_path / "hashes.json"
    cache_file.write_text("{not json")
    assert snapshot.list_workdir(root, snapshot.HashCache(cache_file)).hashed == 4
    assert json.loads(cache_file.read_text())["version"] == snapshot.CACHE_VERSION


# --- the upload, against a server keeping the contract -----------------------------------


class SnapshotPortal:
    """The portal's snapshot endpoints and a lab's pool, as the contract says, on
    loopback. ``cap`` bytes per snapshot; ``refuse_path`` a path it takes no file at;
    ``old`` answers 404 to every snapshot path; ``forget_once`` drops its blobs once,
    between the uploads and the snapshot."""

    def __init__(self, cap: int = 10**6):
        self.cap, self.blobs, self.puts, self.jobs = cap, {}, [], []
        self.refuse_path, self.old, self.forget_once, self.snapshots = "", False, False, []
        self.cap_in_refusal, self.ignores_snapshot, self.cancelled = False, False, []
        # one_at_a_time: a portal that takes a content per request only (PUT).
        self.one_at_a_time, self.bundles, self.refuse_job = False, [], ""
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                assert "Content-Length" in self.headers, "a body without its length"
                return self.rfile.read(int(self.headers["Content-Length"]))

            def do_POST(self):
                if self.path.endswith("/snapshots/blobs"):
                    if portal.old or portal.one_at_a_time:
                        self._body()
                        self._reply(404, {"detail": "Not Found"})
                        return
                    self._reply(*portal.bundle(self.rfile, int(self.headers["Content-Length"]),
                                               self.headers.get("Content-Type")))  # fmt: skip
                    return
                body = json.loads(self._body() or b"{}")
                self._reply(*portal.post(self.path.removeprefix("/api/v1"), body))

            def do_PUT(self):
                # Read as it comes, a chunk at a time: only small contents are kept.
                assert "Content-Length" in self.headers, "a body without its length"
                left, digest, kept = int(self.headers["Content-Length"]), hashlib.sha256(), []
                while left:
                    chunk = self.rfile.read(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
                    digest.update(chunk)
                    if sum(map(len, kept)) < 1 << 16:
                        kept.append(chunk)
                received = (digest.hexdigest(), int(self.headers["Content-Length"]), b"".join(kept))
                self._reply(*portal.put(self.path.removeprefix("/api/v1"), received,
                                        self.headers.get("Content-Type")))  # fmt: skip

            def do_GET(self):
                self._reply(404, {"detail": "Not Found"})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _files_refused(self, files):
        total = sum(f["size"] for f in files)
        if self.refuse_path and any(f["path"] == self.refuse_path for f in files):
            return {"detail": "A path the portal takes no file at.",
                    "errors": {"files": [f"{self.refuse_path}: not a relative path."]}}  # fmt: skip
        if total > self.cap:
            refusal = {"detail": f"The snapshot is {total} bytes; the lab allows {self.cap}.",
                       "errors": {"bytes": [f"{total} > {self.cap}"]}}  # fmt: skip
            numbers = {"bytes": total, "cap_bytes": self.cap}
            return {**refusal, **numbers} if self.cap_in_refusal else refusal
        return None

    def post(self, path, body):
        if self.old and "/snapshots" in path:
            return 404, {"detail": "Not Found"}
        if path == "/labs/vision/jobs/validate":
            if self.refuse_job:
                return 400, {"detail": self.refuse_job, "errors": {}}
            return 200, {"ok": True, "detail": "ok"}
        if path == "/labs/vision/snapshots/missing":
            refused = self._files_refused(body["files"])
            if refused:
                return 400, refused
            missing = sorted({f["sha256"] for f in body["files"]} - set(self.blobs))
            total = sum(f["size"] for f in body["files"])
            return 200, {"missing": missing, "bytes": total, "cap_bytes": self.cap}
        if path == "/labs/vision/snapshots":
            if self.forget_once:
                self.forget_once, self.blobs = False, {}
            lacking = sorted({f["sha256"] for f in body["files"]} - set(self.blobs))
            if lacking:
                return 400, {"detail": "Some contents are missing.", "missing": lacking}
            self.snapshots.append(body["files"])
            return 201, {"id": len(self.snapshots), "digest": "d", "files": len(body["files"]),
                         "bytes": sum(f["size"] for f in body["files"]),
                         "expires_at": "2026-12-05T00:00:00Z"}  # fmt: skip
        if path == "/labs/vision/jobs":
            self.jobs.append(body)
            carried = body.get("snapshot")
            if carried is not None and not self.ignores_snapshot:
                carried = {"id": carried, "digest": "d", "files": 4}
            else:
                carried = None
            job = {"id": 70 + len(self.jobs), "vm_id": None, "vm": None, "lab": "vision",
                   "state": "queued", "reason": "", "accelerator_type": "v4-8",
                   "url": f"{self.url}/labs/vision/jobs/7/"}  # fmt: skip
            # A portal older than snapshots takes the job and says nothing of the field.
            return 201, job if self.ignores_snapshot else {**job, "snapshot": carried}
        cancel = re.fullmatch(r"/labs/vision/jobs/(\d+)/cancel", path)
        if cancel:
            self.cancelled.append(int(cancel[1]))
            return 200, {"id": int(cancel[1]), "state": "cancelled"}
        return 404, {"detail": "Not Found"}

    def bundle(self, stream, length, kind):
        """Many contents in one body, each ``<sha256> <size>\\n`` and its bytes."""
        assert kind == "application/octet-stream"
        got, left = [], length
        while left:
            head = stream.readline(100)
            left -= len(head)
            sha, size = head.decode().split()
            data = stream.read(int(size))
            left -= len(data)
            if hashlib.sha256(data).hexdigest() != sha:
                return 400, {"detail": f"The content's sha256 is not {sha}."}
            got.append((sha, data))
        self.bundles.append([sha for sha, _ in got])
        for sha, data in got:
            self.puts.append(sha)
            self.blobs[sha] = data[: 1 << 16]
        return 200, {"stored": len(got), "had": 0, "bytes": length}

    def put(self, path, received, kind):
        digest, size, head = received
        found = re.fullmatch(r"/labs/vision/snapshots/blobs/([0-9a-f]{64})", path)
        if self.old or not found:
            return 404, {"detail": "Not Found"}
        assert kind == "application/octet-stream"
        if digest != found[1]:
            return 400, {"detail": "The content does not match its sha256."}
        self.puts.append(found[1])
        created = found[1] not in self.blobs
        self.blobs[found[1]] = head
        return (201 if created else 200), {"sha256": found[1], "size": size}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def lab(portal, monkeypatch, tmp_path):
    """The person signed in to a portal keeping the snapshots contract (``portal``
    makes the home and the sign-in; its address is moved here)."""
    from tpu_cli import credentials

    served = SnapshotPortal()
    credentials.save(credentials.SignIn(url=served.url, token="tpp_test", email="milo@x.example"))
    monkeypatch.setenv("TPU_PORTAL_CACHE_DIR", str(tmp_path / "cache"))
    yield served
    served.close()


def _submit(capsys, folder: Path):
    return _run(capsys, "run", "--type", "v4-8", "--lab", "vision", "--workdir", str(folder),
                "--detach", "--", "python3", "train.py")  # fmt: skip


def test_the_workdir_goes_as_a_snapshot_and_the_job_names_it_and_its_folder(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")

    code, err = _submit(capsys, root)

    assert code == 0, err
    [job] = lab.jobs
    assert job["snapshot"] == 1 and job["cwd"] == "proj"  # where a sync to a VM puts it
    assert job["accelerator_type"] == "v4-8" and job["args"] == ["python3", "train.py"]
    [files] = lab.snapshots
    assert sorted(f["path"] for f in files) == [".gitignore", "model/net.py", "run.sh", "train.py"]
    assert len(lab.puts) == 4
    assert lab.blobs[hashlib.sha256(b"x = 1\n").hexdigest()] == b"x = 1\n"
    assert "Snapshot 1 of" in err and "4 file(s)" in err and "sent 4" in err


def test_a_run_after_one_edit_sends_that_file_alone(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    _submit(capsys, root)
    (root / "model/net.py").write_text("x = 2\n")

    code, err = _submit(capsys, root)

    assert code == 0, err
    assert lab.puts[4:] == [hashlib.sha256(b"x = 2\n").hexdigest()]
    assert lab.jobs[1]["snapshot"] == 2 and "sent 1 " in err


def test_small_files_go_many_to_an_upload_and_one_by_one_to_a_portal_without_it(
    lab, capsys, tmp_path
):
    files = {f"src/m{n:03d}.py": f"x = {n}\n" * 50 for n in range(300)}
    root = build(tmp_path / "proj", {**FILES, **files})

    code, err = _submit(capsys, root)

    assert code == 0, err
    assert len(lab.bundles) == 1 and len(lab.puts) == 304 and "sent 304 " in err
    # A portal that takes one content per request: each is sent on its own, no failure.
    lab.one_at_a_time = True
    (root / "src/m007.py").write_text("changed\n")
    (root / "src/m008.py").write_text("changed too\n")
    code, err = _submit(capsys, root)
    assert code == 0, err
    assert len(lab.bundles) == 1 and len(lab.puts) == 306 and "sent 2 " in err


def test_a_job_the_portal_refuses_sends_no_file_though_the_files_were_listed_meanwhile(
    lab, capsys, tmp_path
):
    root = build(tmp_path / "proj")
    lab.refuse_job = "You already have 3 jobs waiting in Vision Lab."

    code, err = _submit(capsys, root)

    assert code != 0 and lab.refuse_job in err
    assert not lab.puts and not lab.bundles and not lab.snapshots and not lab.jobs


def test_contents_the_portal_let_go_are_sent_again_once(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    lab.forget_once = True

    code, err = _submit(capsys, root)

    assert code == 0, err
    assert len(lab.puts) == 8 and lab.jobs[0]["snapshot"] == 1


def test_a_workdir_over_the_cap_says_its_size_the_cap_and_the_largest_files(lab, capsys, tmp_path):
    root = build(tmp_path / "proj", {**FILES, "weights.npy": "w" * 3000, ".gitignore": ""})
    lab.cap = 4000

    code, err = _submit(capsys, root)

    assert code == errors.USAGE
    assert "The snapshot is 8" in err and "the lab allows 4000" in err
    assert "The workdir is 7.8 KB in 7 file(s). Largest: data/big.bin (4.9 KB)" in err
    assert "weights.npy (2.9 KB)" in err and ".gitignore" in err
    assert not lab.puts and not lab.jobs
    # A refusal that gives the cap as a number (as the portal does): the client says it
    # too, in the portal's units, and leaves out the raw numbers of the field's error.
    lab.cap_in_refusal = True
    code, err = _submit(capsys, root)
    assert code == errors.USAGE
    assert "The workdir is 7.8 KB in 7 file(s), over the lab's cap of 3.9 KB on a workdir." in err
    assert " > 4000" not in err


def test_a_path_the_portal_refuses_is_named_and_nothing_is_sent(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    lab.refuse_path = "run.sh"

    code, err = _submit(capsys, root)

    assert code == errors.USAGE
    assert "A path the portal takes no file at." in err and "run.sh: not a relative path." in err
    assert "Largest" not in err
    assert not lab.puts and not lab.jobs


def test_a_portal_without_snapshots_is_named_as_too_old_and_no_job_is_queued(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    lab.old = True

    code, err = _submit(capsys, root)

    assert code == errors.FAILED
    assert "takes no workdir for a job on any VM of a kind" in err and "older than" in err
    assert not lab.jobs


def test_a_portal_that_queues_the_job_without_its_snapshot_has_it_cancelled(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    lab.ignores_snapshot = True

    code, err = _submit(capsys, root)

    assert code == errors.FAILED
    [job] = lab.jobs
    assert job["snapshot"] == 1 and lab.cancelled == [71]
    assert "queued job 71 without its workdir" in err and "was cancelled" in err
    assert "Job 71 queued" not in err


def test_symlinks_left_out_are_named(lab, capsys, tmp_path):
    root = build(tmp_path / "proj")
    (root / "datasets").symlink_to(tmp_path)
    (root / "cfg.py").symlink_to("train.py")

    code, err = _submit(capsys, root)

    assert code == 0, err
    assert "Left out datasets: a symlink out of the workdir" in err
    [files] = lab.snapshots
    assert "cfg.py" in {f["path"] for f in files}


def test_a_large_file_is_streamed_from_disk_not_read_whole(lab, capsys, tmp_path):
    root = build(tmp_path / "proj", {"train.py": "", "run.sh": ""})
    size = 48 * 2**20
    with open(root / "weights.bin", "wb") as handle:
        for _ in range(size // 2**20):
            handle.write(os.urandom(2**20))  # not sparse, not compressible
    lab.cap = 2 * size
    tracemalloc.start()
    try:
        code, err = _submit(capsys, root)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert code == 0, err
    assert len(lab.puts) == 2
    # The hash and the upload each hold a chunk at a time (this process is the server
    # too, and it reads in chunks): far less than the file.
    assert peak < size / 8, peak

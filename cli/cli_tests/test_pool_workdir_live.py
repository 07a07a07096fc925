"""`tpu run --type v4-32 --workdir DIR` against the live portal, the real Celery worker
and beat, and a 4-worker VM of the sshd fleet: the workdir goes to the portal as a
snapshot (the files rsync would send; .gitignore'd ones stay on the laptop), the job is
placed on the only v4-32 and every worker finds the files, folders and modes at the
job's folder; a run after one edit sends exactly one content; a workdir over the lab's
cap is refused with its size and the cap, and nothing is stored."""

from __future__ import annotations

import hashlib
import re

import pytest

from cli_tests.test_fleet_journey import _login, _ok, scene  # noqa: F401 (a fixture)
from tests.test_journey_access import worker_env  # noqa: F401 (a fixture)
from tests.test_journey_jobs import beat  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.fleet]

# Prints every file it is given with its sha256 and mode, whether the ignored file came,
# and where it runs: each worker's own view of the job's folder.
MAIN = """import hashlib, os, socket
for path in ["main.py", "lib/util.py", "lib/deep/table.csv", "run.sh", ".gitignore"]:
    data = open(path, "rb").read()
    print("file", path, hashlib.sha256(data).hexdigest(), oct(os.stat(path).st_mode & 0o777))
print("ignored", os.path.exists("data/secret.bin"), os.path.exists("notes.log"))
print("cwd", os.getcwd(), "on", socket.gethostname())
"""
FILES = {
    "main.py": MAIN,
    "lib/util.py": "VALUE = 1\n",
    "lib/deep/table.csv": "a,b\n1,2\n",
    "run.sh": "#!/bin/sh\necho run\n",
    ".gitignore": "data/\n*.log\n",
    "data/secret.bin": "not for the workers\n",
    "notes.log": "a log\n",
}
SENT = ["main.py", "lib/util.py", "lib/deep/table.csv", "run.sh", ".gitignore"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_pool_job_finds_its_workdir_on_every_worker_and_a_rerun_sends_one(scene, fleet):  # noqa: F811
    from tpus.models import Job, Lab, Snapshot, SnapshotBlob

    laptop = scene.laptop
    _login(scene)
    work = laptop.path("~/proj")
    for path, text in FILES.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    (work / "run.sh").chmod(0o755)
    run = ["run", "--type", "v4-32", "--workdir", "proj", "--venv", "~/jax", "--",
           "python", "main.py"]  # fmt: skip

    first = _ok(scene.tpu(*run, timeout=300))

    home = f"/home/{scene.username}"
    for index in range(4):
        for path in SENT:
            mode = "0o755" if path == "run.sh" else "0o644"
            line = f"(w{index}) file {path} {_sha(FILES[path])} {mode}"
            assert line in first.stdout, (line, first.stdout, first.stderr)
        assert f"(w{index}) ignored False False" in first.stdout
        assert f"(w{index}) cwd {home}/proj on" in first.stdout
    assert re.search(r"Snapshot \d+ of \S+/proj: 5 file\(s\), .*; sent 5 ", first.stderr)
    assert re.search(r"Job \d+ placed on vision/tpu5", first.stderr)
    assert re.search(r"Job \d+ succeeded", first.stderr), first.stderr
    assert SnapshotBlob.objects.filter(owner=scene.milo).count() == 5
    for host in scene.hosts:  # .gitignore kept them on the laptop
        for left in ("data/secret.bin", "notes.log"):
            gone = fleet.exec(host.name, ["test", "-e", f"{home}/proj/{left}"], check=False)
            assert gone.returncode != 0, (host.name, left)

    # One file changes: exactly one content goes to the portal; the workers rewrite it.
    (work / "lib/util.py").write_text("VALUE = 2\n")
    second = _ok(scene.tpu(*run, timeout=300))

    assert re.search(
        r": 5 file\(s\), .*; sent 1 \(10 bytes\), the portal had the rest", second.stderr
    )
    blobs = set(SnapshotBlob.objects.filter(owner=scene.milo).values_list("sha256", flat=True))
    assert len(blobs) == 6 and _sha("VALUE = 2\n") in blobs
    changed = _sha("VALUE = 2\n")
    assert f"(w3) file lib/util.py {changed} 0o644" in second.stdout
    job = Job.objects.order_by("-pk").first()
    assert job.snapshot_id is not None and job.cwd == f"{home}/proj"

    # Over the lab's cap: refused with the workdir's size and the cap; nothing stored.
    Lab.objects.filter(slug="vision").update(snapshot_max_mb=1)
    (work / "weights.npy").write_bytes(b"w" * 1_500_000)
    snapshots, jobs = Snapshot.objects.count(), Job.objects.count()
    refused = scene.tpu(*run, timeout=120)

    assert refused.returncode == 2, refused
    assert "The workdir is 1.4 MB; the lab's cap is 1 MB." in refused.stderr, refused.stderr
    said = "The workdir is 1.4 MB in 6 file(s), over the lab's cap of 1 MB on a workdir."
    assert said in refused.stderr
    assert "weights.npy (1.4 MB)" in refused.stderr
    assert SnapshotBlob.objects.filter(owner=scene.milo).count() == 6
    assert (Snapshot.objects.count(), Job.objects.count()) == (snapshots, jobs)

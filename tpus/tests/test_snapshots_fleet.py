"""Workdir snapshots on real sshd hosts of the test fleet, with the emulator as the
Cloud TPU API: two v4-16 (two workers each) in the lab's pool. A pool job carrying a
snapshot finds its files at its folder on every worker; a run again sends only the
contents a worker's cache lacks; a job moved after a preemption finds its files on the
other VM; and a symlink the person planted (the folder, a file, the cache) never makes
the portal write where the person could not."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from accounts.models import User
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.requirements import need
from tpus.models import Job
from tpus.services import inventory, job_engine, scheduler, snapshots, sync
from tpus.services.grants import grant_access
from tpus.services.jobs import JobSpec, Kind, submit_pool_job

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
# Prints each of its folder's files with its sha256 and mode, and where it runs.
MAIN = b"""import hashlib, os, socket
for path in sorted(["main.py", "lib/util.py", "run.sh"]):
    data = open(path, "rb").read()
    print(path, hashlib.sha256(data).hexdigest(), oct(os.stat(path).st_mode & 0o777))
print("cwd", os.getcwd(), "on", socket.gethostname())
"""
UTIL = b"VALUE = 1\n"
RUN = b"#!/bin/sh\necho run\n"


@pytest.fixture(autouse=True)
def _storage(settings, tmp_path):
    settings.STORAGES = {
        **settings.STORAGES,
        "snapshots": {
            "BACKEND": "django.core.files.storage.FileSystemStorage",
            "OPTIONS": {"location": str(tmp_path / "snapshots")},
        },
    }


@pytest.fixture
def two_v4_16(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    hosts = fleet_hosts(4)
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts[:2], PROJECT, ZONE, "tpu5")
    add_fleet_node(tpu_emulator.controls, fleet, hosts[2:], PROJECT, ZONE, "tpu6")
    give_lab_key(fleet, hosts, lab)
    vms = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5", f"{ZONE}/tpu6"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    with django_capture_on_commit_callbacks(execute=True):
        grants = grant_access(admin, lab, milo, vms, sudo=False)
    for grant in grants:
        grant.refresh_from_db()
        assert grant.state == "active", grant.error
    for host in hosts:
        fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{fleet_username}/venv"])
    vms = sorted(vms, key=lambda vm: vm.name)
    yield lab, vms, User.objects.get(pk=milo.pk), hosts
    for job in Job.objects.filter(state__in=["running", "cancelling", "starting"]):
        job_engine.stop_on_workers(job, grace=0)


def _snapshot(milo, lab, files: dict[str, tuple[bytes, int]]):
    manifest = [
        {"path": p, "size": len(c), "mode": m, "sha256": hashlib.sha256(c).hexdigest()}
        for p, (c, m) in files.items()
    ]
    for content, _ in files.values():
        snapshots.store_blob(
            milo, lab, hashlib.sha256(content).hexdigest(), _Body(content), len(content)
        )
    return snapshots.create_snapshot(milo, lab, manifest)[0]


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n: int) -> bytes:
        chunk, self.data = self.data[:n], self.data[n:]
        return chunk


FILES = {"main.py": (MAIN, 0o644), "lib/util.py": (UTIL, 0o644), "run.sh": (RUN, 0o755)}


def _expected(files) -> list[str]:
    return [
        f"{p} {hashlib.sha256(c).hexdigest()} {oct(m)}"
        for p, (c, m) in sorted(files.items())
        if p in ("main.py", "lib/util.py", "run.sh")
    ]


def _passes_until(job: Job, capture, done, seconds: float = 90) -> Job:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if done(job):
            return job
        with capture(execute=True):
            if job.vm_id is None:
                scheduler.place(job.lab_id)
            else:
                job_engine.advance(job.vm_id)
        time.sleep(0.3)
    pytest.fail(f"job {job.pk} is still {job.state} on {job.vm_id}: {job.reason}")


def _run(milo, lab, snapshot, capture, *, cwd="~/proj", **fields) -> Job:
    spec = JobSpec(
        args=["python", "main.py"], python="~/venv", cwd=cwd, snapshot=snapshot.pk, **fields
    )
    with capture(execute=True):
        job = submit_pool_job(milo, lab, Kind("v4-16"), spec)
    return _passes_until(job, capture, lambda j: j.has_ended)


def _cached(job: Job) -> list[str]:
    return [c[2] for rows in job.preflight.values() for c in rows if c[0] == "snapshot"]


def _placed(job: Job) -> list[str]:
    return [c[2] for rows in job.preflight.values() for c in rows if c[0] == "snapshot_place"]


def test_a_pool_job_finds_its_workdir_on_every_worker_and_a_rerun_sends_only_the_change(
    two_v4_16, django_capture_on_commit_callbacks, fleet
):
    lab, (tpu5, tpu6), milo, hosts = two_v4_16
    capture = django_capture_on_commit_callbacks
    job = _run(milo, lab, _snapshot(milo, lab, FILES), capture)
    assert job.state == "succeeded", (job.reason, job.preflight)
    parts = list(job.parts.order_by("index"))
    assert len(parts) == 2
    home = f"/home/{milo.unix_account.username}"
    for part in parts:
        for line in _expected(FILES):
            assert line in part.log_tail, (part.index, part.log_tail)
        assert f"cwd {home}/proj" in part.log_tail
    assert _cached(job) == ["0 of 3 contents cached"] * 2
    assert _placed(job) == ["3 file(s) written, 0 already there, 3 content(s) received"] * 2
    # Written as the person, in their home: the files and the cache are theirs.
    vm_hosts = hosts[:2] if job.vm_id == tpu5.pk else hosts[2:]
    owner = fleet.exec(vm_hosts[1].name, ["stat", "-c", "%U %a", f"{home}/proj/run.sh"])
    assert owner.stdout.decode().split() == [milo.unix_account.username, "755"]
    cache = fleet.exec(vm_hosts[1].name, ["stat", "-c", "%U %a", f"{home}/.cache/tpu-portal/blobs"])
    assert cache.stdout.decode().split() == [milo.unix_account.username, "700"]

    # One file changed: the VM's workers lack only its new content.
    changed = {**FILES, "lib/util.py": (b"VALUE = 2\n", 0o644)}
    again = _run(milo, lab, _snapshot(milo, lab, changed), capture)
    assert again.state == "succeeded", (again.reason, again.preflight)
    assert again.vm_id == job.vm_id  # the first free VM of the kind by name, as before
    assert _cached(again) == ["2 of 3 contents cached"] * 2
    assert _placed(again) == ["1 file(s) written, 2 already there, 1 content(s) received"] * 2
    for part in again.parts.all():
        for line in _expected(changed):
            assert line in part.log_tail, (part.index, part.log_tail)


def test_a_job_moved_after_a_preemption_finds_its_workdir_on_the_other_vm(
    two_v4_16, tpu_emulator, django_capture_on_commit_callbacks
):
    lab, (tpu5, tpu6), milo, _ = two_v4_16
    capture = django_capture_on_commit_callbacks
    snapshot = _snapshot(
        milo, lab, {**FILES, "main.py": (MAIN + b"import time; time.sleep(8)\n", 0o644)}
    )
    spec = JobSpec(
        args=["python", "main.py"], python="~/venv", cwd="~/proj", snapshot=snapshot.pk,
        rerun_after_preemption=True,
    )  # fmt: skip
    with capture(execute=True):
        job = submit_pool_job(milo, lab, Kind("v4-16"), spec)
    job = _passes_until(job, capture, lambda j: j.state == "running")
    assert job.vm_id == tpu5.pk
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    with capture(execute=True):
        job_engine.advance(tpu5.pk)
    job.refresh_from_db()
    assert job.state == "lost"
    again = Job.objects.get(rerun_of=job)
    assert again.vm_id == tpu6.pk and again.snapshot_id == snapshot.pk
    again = _passes_until(again, capture, lambda j: j.has_ended)
    assert again.state == "succeeded", (again.reason, again.preflight)
    for part in again.parts.all():
        assert "main.py " in part.log_tail and "lib/util.py " in part.log_tail, part.log_tail
    # Kept while the moved job needed it.
    snapshot.refresh_from_db()


@pytest.mark.parametrize(
    "plant",
    ["folder", "cache"],
)
def test_a_symlink_the_person_planted_never_leads_the_portal_to_write_where_they_cannot(
    two_v4_16, django_capture_on_commit_callbacks, fleet, plant
):
    lab, (tpu5, tpu6), milo, hosts = two_v4_16
    capture = django_capture_on_commit_callbacks
    user = milo.unix_account.username
    home = f"/home/{user}"
    # ~/proj -> /etc on the second worker of each VM only (the first places its files
    # and waits for the word, which never comes), or the cache -> /etc everywhere.
    for host in hosts[1::2] if plant == "folder" else hosts:
        if plant == "folder":
            link = f"{home}/proj"
        else:
            fleet.exec(
                host.name, ["install", "-d", "-o", user, "-g", user, f"{home}/.cache/tpu-portal"]
            )
            link = f"{home}/.cache/tpu-portal/blobs"
        fleet.exec(host.name, ["ln", "-sfn", "/etc", link])
        fleet.exec(host.name, ["chown", "-h", f"{user}:{user}", link])
    files = {**FILES, "portal-was-here": (b"owned\n", 0o644)}
    job = _run(milo, lab, _snapshot(milo, lab, files), capture)
    assert job.state == "failed", (job.reason, job.preflight)
    assert "Its workdir could not be placed on" in job.reason
    assert "Permission denied" in job.reason
    # Nothing started on any worker; nothing was written in /etc.
    assert not job.parts.filter(state__in=["running", "ended"]).exists()
    assert all(p.pid is None for p in job.parts.all())
    if plant == "folder":
        assert "worker 1 (" in job.reason and "worker 0 (" not in job.reason
        first = (hosts[:2] if job.vm_id == tpu5.pk else hosts[2:])[0]
        # Worker 0 has its files, and runs nothing of the person's.
        fleet.exec(first.name, ["test", "-f", f"{home}/proj/main.py"])
        running = fleet.exec(first.name, ["pgrep", "-u", user], check=False)
        assert running.returncode == 1, running.stdout
    for host in hosts:
        for name in ("portal-was-here", "main.py", "run.sh"):
            assert (
                fleet.exec(host.name, ["test", "-e", f"/etc/{name}"], check=False).returncode != 0
            )
        listing = fleet.exec(host.name, ["ls", "-a", "/etc"]).stdout.decode()
        assert ".incoming-" not in listing and ".tpu-portal-" not in listing


def test_a_symlinked_file_in_the_folder_is_replaced_not_written_through(
    two_v4_16, django_capture_on_commit_callbacks, fleet
):
    lab, _, milo, hosts = two_v4_16
    capture = django_capture_on_commit_callbacks
    user = milo.unix_account.username
    home = f"/home/{user}"
    for host in hosts:
        fleet.exec(
            host.name,
            ["sh", "-c", "echo root-only > /etc/portal-target; chmod 644 /etc/portal-target"],
        )
        fleet.exec(host.name, ["install", "-d", "-o", user, "-g", user, f"{home}/proj"])
        fleet.exec(host.name, ["ln", "-sfn", "/etc/portal-target", f"{home}/proj/run.sh"])
        fleet.exec(host.name, ["chown", "-h", f"{user}:{user}", f"{home}/proj/run.sh"])
        # A file the snapshot does not name stays, as rsync without --delete leaves it.
        fleet.exec(host.name, ["sh", "-c", f"echo mine > {home}/proj/notes.txt"])
    job = _run(milo, lab, _snapshot(milo, lab, FILES), capture)
    assert job.state == "succeeded", (job.reason, job.preflight)
    for host in hosts:
        target = fleet.exec(host.name, ["cat", "/etc/portal-target"]).stdout
        assert target == b"root-only\n"
        kept = fleet.exec(host.name, ["cat", f"{home}/proj/notes.txt"]).stdout
        assert kept == b"mine\n"
    for part in job.parts.all():
        for line in _expected(FILES):
            assert line in part.log_tail

"""Data disks on real fleet hosts, the emulator as the Cloud TPU API: a revoke that goes
through on a VM whose disk rows clash, a detach that unmounts before the API detaches
(and waits while the disk is busy), and a device that appears after the reconcile ran,
again after a reboot. A disk is a loop device whose node and /dev/disk/by-id link are
made in the host's own /dev when the test "plugs" it."""

from __future__ import annotations

import os
import secrets
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.urls import reverse

from accounts.keys import add_key
from accounts.models import User
from accounts.unix import choose_username
from portal.audit import AuditAction
from testfleet.fixtures import add_fleet_node, give_lab_key
from tpus.cloud import CloudTPU
from tpus.models import AuditEvent, DataDisk, DiskAttachment, Grant, TpuVm
from tpus.models.inventory import DiskOperation, DiskOperationState
from tpus.services import disk_mounts, disk_operations, inventory, job_engine
from tpus.services.grants import grant_access, revoke_access
from tpus.services.hosts import hosts_must_change

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


@dataclass
class Scene:
    fleet: object
    hosts: list
    lab: object
    admin: object
    milo: object
    vm: TpuVm
    key: Path
    emulator: object

    @property
    def host(self):
        return self.hosts[0]

    def sh(self, script: str, host=None) -> str:
        """A shell snippet as root inside a host (worker 0 unless given); its stdout."""
        done = self.fleet.exec((host or self.host).name, ["sh", "-c", script])
        return done.stdout.decode()

    def ssh(self, user: str) -> int:
        known = self.key.with_name("known_hosts")
        known.write_text(
            "".join(f"{self.host.ip} {k}\n" for k in self.fleet.host_keys(self.host.name))
        )
        return subprocess.run(
            ["ssh", "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
             "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
             f"{user}@{self.host.ip}", "true"],
            capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
        ).returncode  # fmt: skip

    def mounted_at(self, point: str, host=None) -> str:
        return self.sh(f"findmnt -n -o SOURCE {point}; true", host).strip()

    def cloud_disks(self) -> list[str]:
        return [d.name for d in self.emulator.client.get_node(PROJECT, ZONE, "tpu9").data_disks]


@pytest.fixture(autouse=True)
def _looks_again_by_the_beat(monkeypatch):
    """These tests play the beat themselves (``disk_mounts.recheck_due``) to say when the
    workers are looked at again; the look a reconcile queues for later would otherwise
    run in this process as soon as it is due, before the test could see the state in
    between."""
    from tpus import queue

    monkeypatch.setattr(queue, "recheck_disks", lambda vm_id, seconds: None)


@pytest.fixture
def make_scene(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, settings,
    tmp_path, make_lab, make_user, add_member,
):  # fmt: skip
    """``make_scene(n)``: a lab with an emulated TPU VM tpu9 whose n workers are fleet
    hosts, and milo (a member with a key, no access yet)."""

    def make(workers: int) -> Scene:
        return _scene(
            tpu_emulator, fleet, fleet_hosts(workers), fleet_username, settings, tmp_path,
            make_lab, make_user, add_member,
        )  # fmt: skip

    return make


@pytest.fixture
def scene(make_scene) -> Scene:
    return make_scene(1)


def _scene(
    tpu_emulator, fleet, hosts, fleet_username, settings, tmp_path, make_lab, make_user,
    add_member,
) -> Scene:  # fmt: skip
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu9")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu9"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    add_key(milo, key.with_suffix(".pub").read_text().strip())
    milo = User.objects.select_related("unix_account").get(pk=milo.pk)
    # Looked for again every second in these tests, not every five.
    settings.PORTAL_DISK_RECHECK_SECONDS = 1
    return Scene(fleet, hosts, lab, admin, milo, vm, key, tpu_emulator)


class LoopDisk:
    """An ext4 disk for the scene's hosts: a loop device of this machine whose node and
    ``/dev/disk/by-id/google-<name>`` link appear in each host's /dev on ``plug()``."""

    def __init__(self, scene: Scene, tmp_path: Path):
        self.scene = scene
        self.name = f"data-{secrets.token_hex(3)}"
        image = tmp_path / f"{self.name}.img"
        subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        self.loop = subprocess.run(
            ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
        ).stdout.strip()
        scene.emulator.controls.add_disk(PROJECT, ZONE, self.name)

    def plug(self) -> None:
        rdev = os.stat(self.loop).st_rdev
        for host in self.scene.hosts:
            self.scene.sh(
                f"[ -e {self.loop} ] || "
                f"mknod -m 660 {self.loop} b {os.major(rdev)} {os.minor(rdev)}; mkdir -p "
                f"/dev/disk/by-id && ln -sf {self.loop} /dev/disk/by-id/google-{self.name}",
                host,
            )

    def plug_later(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.plug)
        timer.start()
        return timer


@pytest.fixture
def make_loop_disk(tmp_path):
    made = []

    def make(scene: Scene) -> LoopDisk:
        made.append(LoopDisk(scene, tmp_path))
        return made[-1]

    yield make
    for disk in made:
        # A fresh /dev and no mounts; then the loop device can go.
        for host in disk.scene.hosts:
            disk.scene.fleet.reboot(host.name)
        subprocess.run(["losetup", "-d", disk.loop], check=False)


@pytest.fixture
def loop_disk(scene, make_loop_disk) -> LoopDisk:
    return make_loop_disk(scene)


def _register(scene: Scene, name: str, point: str) -> DataDisk:
    return inventory.register_disk(
        scene.admin, scene.lab, name=name, zone=ZONE, size_gb=1, mount_point=point
    )


def _until(condition, seconds: float, what: str, *, beat=None):
    """Wait until ``condition()`` holds, running ``beat()`` (what Celery beat would
    run) between looks; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds} s")
        if beat is not None:
            beat()
        time.sleep(0.2)


def _vm_page(client, scene) -> str:
    client.force_login(scene.admin)
    return client.get(reverse("vm_detail", args=["vision", scene.vm.pk])).content.decode()


# --- a clash in the disk rows never holds a revoke ------------------------------------


def test_a_revoke_goes_through_on_a_vm_whose_disks_share_a_mount_point(
    scene, client, django_capture_on_commit_callbacks
):
    # Rows from before the portal refused this (or disks attached outside it, which
    # all get the default mount point).
    for name in ("imagenet", "laion"):
        disk = DataDisk.objects.create(
            lab=scene.lab, name=name, zone=ZONE, mount_point="/mnt/disks/shared"
        )
        DiskAttachment.objects.create(disk=disk, vm=scene.vm)
    username = scene.milo.unix_account.username
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(scene.admin, scene.lab, scene.milo, [scene.vm], sudo=True)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert scene.ssh(username) == 0

    with django_capture_on_commit_callbacks(execute=True):
        revoke_access(scene.admin, grant)

    grant.refresh_from_db()
    assert grant.state == "revoked"
    assert scene.ssh(username) != 0
    gone = (
        f"[ ! -e /etc/ssh/tpu-portal-keys/{username} ] && "
        f"[ ! -e /etc/sudoers.d/tpu-portal-{username} ] && echo gone"
    )
    assert scene.sh(gone).strip() == "gone"
    assert scene.sh(f"getent shadow {username}").split(":")[1] == "!*"
    # The disk part is reported on its own: the first disk waits for its device (no
    # fstab line until it is mounted), the second is not mounted, and the page says why.
    assert scene.sh("grep tpu-portal /etc/fstab; true") == ""
    assert scene.vm.workers.get().sync.last_report["waiting_device"] == ["imagenet"]
    page = _vm_page(client, scene)
    assert "Not mounted: /mnt/disks/shared is already where imagenet is mounted" in page
    assert not Grant.objects.filter(state="revoking").exists()


# --- detach: every worker unmounts first ----------------------------------------------


def test_a_detach_unmounts_on_every_worker_first_and_waits_while_one_holds_the_disk(
    make_scene, make_loop_disk, client, django_capture_on_commit_callbacks, monkeypatch
):
    scene = make_scene(2)
    loop_disk = make_loop_disk(scene)
    first, second = scene.hosts
    point = f"/mnt/disks/{loop_disk.name}"
    disk = _register(scene, loop_disk.name, point)
    loop_disk.plug()
    with django_capture_on_commit_callbacks(execute=True):
        disk_operations.request_operation(scene.admin, disk, scene.vm, "attach")
    assert [scene.mounted_at(point, h) for h in scene.hosts] == [loop_disk.loop] * 2
    # What the workers had mounted when the API was asked to detach.
    seen_at_detach = []
    real_detach = CloudTPU.begin_detach_disk

    def begin_detach_disk(self, *args, **kwargs):
        seen_at_detach.append([scene.mounted_at(point, h) for h in scene.hosts])
        return real_detach(self, *args, **kwargs)

    monkeypatch.setattr(CloudTPU, "begin_detach_disk", begin_detach_disk)
    # Someone works in the disk's folder on the second worker.
    busy = scene.sh(f"cd {point} && sleep 300 </dev/null >/dev/null 2>&1 & echo $!", second)
    busy = busy.strip()

    with django_capture_on_commit_callbacks(execute=True):
        operation = disk_operations.request_operation(scene.admin, disk, scene.vm, "detach")

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.UNMOUNTING
    assert operation.error.startswith(f"tpu9-w1: cannot unmount {point}")
    assert f"(held by pid {busy} sleep of root)" in operation.error
    assert seen_at_detach == [] and scene.cloud_disks() == [loop_disk.name]
    assert scene.mounted_at(point, first) == ""  # the free worker let go at once
    assert scene.mounted_at(point, second) == loop_disk.loop
    page = _vm_page(client, scene)
    assert "being detached: unmounting on the workers" in page
    assert f"held by pid {busy} sleep of root" in page

    scene.sh(f"kill -KILL {busy}", second)

    def beat():
        with django_capture_on_commit_callbacks(execute=True):
            disk_mounts.recheck_due()

    _until(
        lambda: DiskOperation.objects.get(pk=operation.pk).state == DiskOperationState.DONE,
        30,
        "the detach did not finish once the disk was free",
        beat=beat,
    )
    assert seen_at_detach == [["", ""]]  # unmounted everywhere before the API detached it
    assert scene.cloud_disks() == []
    for host in scene.hosts:
        assert scene.sh("grep tpu-portal /etc/fstab; true", host) == ""
    assert not DiskAttachment.objects.filter(disk=disk).exists()


# --- a device that comes late ------------------------------------------------------------


def test_a_device_that_appears_after_the_attach_is_mounted_and_again_after_a_reboot(
    scene, loop_disk, client, django_capture_on_commit_callbacks
):
    point = f"/mnt/disks/{loop_disk.name}"
    disk = _register(scene, loop_disk.name, point)

    def beat():
        with django_capture_on_commit_callbacks(execute=True):
            disk_mounts.recheck_due()

    with django_capture_on_commit_callbacks(execute=True):
        disk_operations.request_operation(scene.admin, disk, scene.vm, "attach")
    # Hot-plug is not instant: the worker shows the device a few seconds later.
    timer = loop_disk.plug_later(3)

    assert scene.mounted_at(point) == ""
    assert "waiting for the device" in _vm_page(client, scene)
    _until(lambda: scene.mounted_at(point), 30, "the disk was not mounted", beat=beat)
    timer.join()
    assert "mounted on every worker" in _vm_page(client, scene)

    # A reboot: no mount, a fresh /dev, and the device comes back late again. The
    # portal sees the new boot id (here in the scheduled look at who holds an idle
    # VM's chips, which reads each worker's job status) and looks again.
    scene.fleet.reboot(scene.host.name)
    assert scene.mounted_at(point) == ""
    timer = loop_disk.plug_later(3)
    with django_capture_on_commit_callbacks(execute=True):
        assert job_engine.check_usage(scene.vm.pk) == []

    assert "waiting for the device" in _vm_page(client, scene)
    _until(lambda: scene.mounted_at(point), 30, "the disk was not mounted again", beat=beat)
    timer.join()
    assert "mounted on every worker" in _vm_page(client, scene)


# --- the looks at a late device, as often as the setting says ----------------------


@pytest.fixture
def worker_env(monkeypatch, settings, tpu_emulator, fleet_settings, fleet_uids):
    """What the Celery worker process must see: the test's emulator, the fleet's admin
    key, this run's UIDs, and a look at a late disk every 2 s for up to a minute."""
    monkeypatch.setenv("PORTAL_UID_MIN", str(settings.PORTAL_UID_MIN))
    monkeypatch.setenv("PORTAL_UID_MAX", str(settings.PORTAL_UID_MAX))
    monkeypatch.setenv("PORTAL_TEST_TPU_API_ENDPOINT", settings.TPU_API_ENDPOINT)
    monkeypatch.setenv("PORTAL_ADMIN_SSH_KEY_FILE", settings.PORTAL_ADMIN_SSH_KEY_FILE)
    monkeypatch.setenv("PORTAL_ADMIN_SSH_USER", settings.PORTAL_ADMIN_SSH_USER)
    monkeypatch.setenv("PORTAL_REMOTE_CONNECT_TIMEOUT", "5")
    monkeypatch.setenv("PORTAL_REMOTE_AUTH_TIMEOUT", "10")
    monkeypatch.setenv("PORTAL_REMOTE_SCRIPT_TIMEOUT", "60")
    monkeypatch.setenv("PORTAL_DISK_RECHECK_SECONDS", "2")
    monkeypatch.setenv("PORTAL_DISK_DEVICE_WAIT_SECONDS", "60")


def test_a_late_device_is_looked_for_again_every_recheck_interval(
    worker_env, celery_worker_process, celery_beat, scene, loop_disk
):
    # A real worker and beat (whose disk-recheck only stands behind lost looks: the
    # reconcile queues the next look for when it is due).
    celery_beat(PORTAL_DISK_RECHECK_SECONDS="2", PORTAL_SYNC_SECONDS="3600")
    disk = _register(scene, loop_disk.name, f"/mnt/disks/{loop_disk.name}")
    DiskAttachment.objects.create(disk=disk, vm=scene.vm)
    hosts_must_change(scene.vm, "a disk was attached")

    looks = AuditEvent.objects.filter(action=AuditAction.VM_RECONCILED, data__vm=scene.vm.pk)
    _until(lambda: looks.count() >= 5, 40, "the workers were not looked at five times")

    times = list(looks.order_by("created_at").values_list("created_at", flat=True))[:5]
    gaps = [round((b - a).total_seconds(), 2) for a, b in zip(times, times[1:], strict=False)]
    # Every 2 s, counted from when the last look began: not 2 s after it ended, then
    # up to a beat later (which made 5 s into 10 s; 2 s into 3.9–4.0 s). A loaded machine
    # can delay one look (and the gap after it is that much shorter), so the typical
    # gap is what is held to the interval; no two looks come close together.
    assert all(gap >= 1.0 for gap in gaps), gaps
    assert 1.5 <= statistics.median(gaps) <= 3.0, gaps
    assert "waiting for the device" in disk_mounts.disk_rows(scene.vm)[0].state

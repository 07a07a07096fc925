"""Data disks on a VM's workers, without hosts: one mount point per disk, a detach that
waits for every worker to unmount, and the bounded wait for a device (the hosts'
side is in test_disks_on_hosts.py)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from tpus import queue
from tpus.models import DataDisk, DiskAttachment, TpuVm, Worker, WorkerSync
from tpus.models.inventory import AttachmentState, DiskOperation, DiskOperationState
from tpus.services import disk_mounts, disk_operations, inventory
from tpus.services.inventory import InventoryError
from tpus.services.reconcile import desired_state

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


@pytest.fixture
def scene(tpu_emulator, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1", workers=1)
    for name in ("imagenet", "laion"):
        tpu_emulator.controls.add_disk(PROJECT, ZONE, name)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu1"])
    disks = {
        name: inventory.register_disk(
            admin, lab, name=name, zone=ZONE, size_gb=10, mount_point="/mnt/disks/data"
        )
        for name in ("imagenet", "laion")
    }
    tpu_emulator.lab, tpu_emulator.admin, tpu_emulator.vm, tpu_emulator.disks = (
        lab,
        admin,
        vm,
        disks,
    )
    return tpu_emulator


def _cloud_disks(scene) -> list[str]:
    return [d.name for d in scene.client.get_node(PROJECT, ZONE, "tpu1").data_disks]


# --- one mount point, one disk --------------------------------------------------------


def test_a_second_disk_for_a_taken_mount_point_is_refused_before_the_api_is_asked(
    scene, client, django_capture_on_commit_callbacks
):
    imagenet, laion = scene.disks["imagenet"], scene.disks["laion"]
    inventory.attach_disk(scene.admin, imagenet, scene.vm, "READ_ONLY")
    updates = scene.requests["UpdateNode"]
    client.force_login(scene.admin)

    with django_capture_on_commit_callbacks(execute=True):
        page = client.post(
            reverse("disk_detail", args=["vision", laion.pk]),
            {"vm": scene.vm.pk, "mode": "READ_ONLY"},
        )
    api = client.post(
        f"/api/v1/labs/vision/disks/{laion.pk}/attach",
        {"vm_id": scene.vm.pk, "mode": "READ_ONLY"},
        content_type="application/json",
    )
    with pytest.raises(InventoryError) as refused:
        disk_operations.request_operation(scene.admin, laion, scene.vm, "attach")

    message = (
        "imagenet is already mounted at /mnt/disks/data on tpu1, and two disks cannot share "
        "a mount point on one VM. Detach imagenet first, or attach a disk registered with "
        "another mount point."
    )
    assert page.status_code == 200 and message in page.content.decode()
    assert (api.status_code, api.json()) == (400, {"detail": message})
    assert str(refused.value) == message
    assert not laion.operations.exists()
    assert scene.requests["UpdateNode"] == updates  # the API was never asked
    assert _cloud_disks(scene) == ["imagenet"]


def test_two_requests_for_one_mount_point_at_once_let_only_the_first_through(scene):
    imagenet, laion = scene.disks["imagenet"], scene.disks["laion"]

    first = disk_operations.request_operation(scene.admin, imagenet, scene.vm, "attach")
    with pytest.raises(InventoryError, match="imagenet is already mounted at /mnt/disks/data"):
        disk_operations.request_operation(scene.admin, laion, scene.vm, "attach")

    assert list(DiskOperation.objects.values_list("pk", flat=True)) == [first.pk]


def test_rows_that_share_a_mount_point_leave_the_later_disk_out_and_say_why(scene, client):
    # As a VM may hold them from before the check (or disks attached outside the portal,
    # which all get the default mount point).
    imagenet, laion = scene.disks["imagenet"], scene.disks["laion"]
    DiskAttachment.objects.create(disk=imagenet, vm=scene.vm)
    DiskAttachment.objects.create(disk=laion, vm=scene.vm)

    state = desired_state(scene.vm)

    assert [(m.device, m.mount_point) for m in state.mounts] == [("imagenet", "/mnt/disks/data")]
    client.force_login(scene.admin)
    page = client.get(reverse("vm_detail", args=["vision", scene.vm.pk])).content.decode()
    assert "Not mounted: /mnt/disks/data is already where imagenet is mounted on this VM" in page
    progress = client.get(reverse("vm_progress", args=["vision", scene.vm.pk])).content.decode()
    assert "laion: Not mounted: /mnt/disks/data is already where imagenet is mounted" in progress


# --- detach: unmounted on every worker first ----------------------------------------


def _answered(worker: Worker, version: int, **report) -> None:
    """What a worker's reconcile at ``version`` answered (as reconcile._record keeps it)."""
    WorkerSync.objects.update_or_create(
        worker=worker,
        defaults={
            "applied_version": version,
            "last_success_at": timezone.now(),
            "last_attempt_at": timezone.now(),
            "last_report": {"values": {"boot_id": "b1", "changed": "0"}, **report},
        },
    )


@pytest.fixture
def mounted(scene):
    """imagenet attached and mounted on tpu1's worker (its reconcile answered)."""
    disk = scene.disks["imagenet"]
    inventory.attach_disk(scene.admin, disk, scene.vm, "READ_ONLY")
    scene.vm.refresh_from_db()
    _answered(scene.vm.workers.get(), scene.vm.desired_version)
    return disk


def _detach(scene, disk) -> DiskOperation:
    operation = disk_operations.request_operation(scene.admin, disk, scene.vm, "detach")
    disk_operations.run_operation(operation.pk)
    operation.refresh_from_db()
    return operation


def test_a_detach_waits_for_the_workers_before_asking_the_api(scene, mounted):
    operation = _detach(scene, mounted)

    assert operation.state == DiskOperationState.UNMOUNTING
    attachment = DiskAttachment.objects.get(disk=mounted)
    assert attachment.state == AttachmentState.DETACHING
    assert desired_state(scene.vm).mounts == ()  # the workers unmount it
    assert _cloud_disks(scene) == ["imagenet"]  # and the API has not been asked yet
    disk_operations.run_operation(operation.pk)  # no worker has answered since
    assert _cloud_disks(scene) == ["imagenet"]

    _answered(scene.vm.workers.get(), operation.hosts_version)
    disk_operations.run_operation(operation.pk)

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.DONE
    assert _cloud_disks(scene) == []
    assert not DiskAttachment.objects.exists()


def test_a_busy_disk_is_shown_and_never_detached_while_it_is_held(scene, mounted, settings):
    operation = _detach(scene, mounted)
    busy = (
        "imagenet:cannot unmount /mnt/disks/data: umount: /mnt/disks/data: target is busy. "
        "(held by pid 812 python3 of milo)"
    )
    _answered(scene.vm.workers.get(), operation.hosts_version, mount_error=[busy])

    disk_operations.run_operation(operation.pk)

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.UNMOUNTING
    assert operation.error == (
        "tpu1-w0: cannot unmount /mnt/disks/data: umount: /mnt/disks/data: target is busy. "
        "(held by pid 812 python3 of milo)"
    )
    assert _cloud_disks(scene) == ["imagenet"]

    settings.PORTAL_DISK_UNMOUNT_WAIT_SECONDS = 0  # the wait is over
    disk_operations.run_operation(operation.pk)

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.FAILED
    assert operation.error.startswith("Not detached: tpu1-w0: cannot unmount /mnt/disks/data")
    assert "The disk stays attached and mounted" in operation.error
    assert _cloud_disks(scene) == ["imagenet"]
    assert DiskAttachment.objects.get(disk=mounted).state == AttachmentState.ATTACHED
    assert [m.device for m in desired_state(scene.vm).mounts] == ["imagenet"]


def test_a_busy_worker_is_looked_at_again_within_the_wait(scene, mounted):
    operation = _detach(scene, mounted)
    worker = scene.vm.workers.get()
    busy = "imagenet:cannot unmount /mnt/disks/data: target is busy."
    _answered(worker, operation.hosts_version, mount_error=[busy])

    disk_mounts.after_run(scene.vm.pk, [worker.index])

    assert WorkerSync.objects.get(worker=worker).disk_recheck_at is not None
    assert disk_mounts.due_rechecks() == []  # not yet
    WorkerSync.objects.update(disk_recheck_at=timezone.now())
    assert disk_mounts.due_rechecks() == [scene.vm.pk]
    assert disk_mounts.due_rechecks() == []  # claimed once


def test_a_stopped_vm_has_its_disk_detached_at_once(scene, mounted):
    TpuVm.objects.filter(pk=scene.vm.pk).update(state="STOPPED")
    scene.vm.refresh_from_db()

    operation = _detach(scene, mounted)

    assert operation.state == DiskOperationState.DONE
    assert _cloud_disks(scene) == []


def test_attaching_a_disk_that_is_being_detached_is_refused(scene, mounted):
    _detach(scene, mounted)

    with pytest.raises(InventoryError, match="imagenet is being detached from tpu1"):
        inventory.check_attach(mounted, scene.vm, "READ_ONLY")


# --- a device that comes late ---------------------------------------------------------


def test_a_device_that_is_not_there_yet_is_looked_for_again_then_reported(
    scene, mounted, client, settings
):
    worker = scene.vm.workers.get()
    _answered(worker, scene.vm.desired_version, waiting_device=["imagenet"])

    disk_mounts.after_run(scene.vm.pk, [worker.index])

    sync = WorkerSync.objects.get(worker=worker)
    assert sync.disk_waits["boot"] == "b1" and "imagenet" in sync.disk_waits["devices"]
    assert sync.disk_recheck_at is not None
    client.force_login(scene.admin)
    page = client.get(reverse("vm_detail", args=["vision", scene.vm.pk])).content.decode()
    assert "waiting for the device" in page
    progress = client.get(reverse("vm_progress", args=["vision", scene.vm.pk])).content.decode()
    assert "waiting for the device of disk imagenet" in progress

    # Past the wait: no more looks, and the page says what went wrong.
    long_ago = (timezone.now() - dt.timedelta(seconds=121)).isoformat()
    WorkerSync.objects.filter(pk=sync.pk).update(
        disk_waits={"boot": "b1", "devices": {"imagenet": long_ago}}
    )
    disk_mounts.after_run(scene.vm.pk, [worker.index])

    assert WorkerSync.objects.get(pk=sync.pk).disk_recheck_at is None
    page = client.get(reverse("vm_detail", args=["vision", scene.vm.pk])).content.decode()
    assert (
        "tpu1-w0: the disk&#x27;s device (/dev/disk/by-id/google-imagenet) did not appear within "
        "120 s" in page
    )
    progress = client.get(reverse("vm_progress", args=["vision", scene.vm.pk])).content.decode()
    assert "waiting for the device" not in progress
    assert "disk imagenet: the disk&#x27;s device (/dev/disk/by-id/google-imagenet) did not" in (
        progress
    )


def test_the_next_look_is_one_interval_after_this_one_began_and_queued_for_then(
    scene, mounted, settings, monkeypatch, django_capture_on_commit_callbacks
):
    settings.PORTAL_DISK_RECHECK_SECONDS = 5
    sent = []
    monkeypatch.setattr(
        queue, "_send", lambda name, *args, countdown=None: sent.append((name, args, countdown))
    )
    worker = scene.vm.workers.get()
    _answered(worker, scene.vm.desired_version, waiting_device=["imagenet"])
    began = timezone.now() - dt.timedelta(seconds=1.5)  # the run took 1.5 s

    with django_capture_on_commit_callbacks(execute=True):
        disk_mounts.after_run(scene.vm.pk, [worker.index], looked_at=began)

    due = WorkerSync.objects.get(worker=worker).disk_recheck_at
    assert due == began + dt.timedelta(seconds=5)  # not 5 s after the run ended
    [(name, args, countdown)] = sent
    assert (name, args) == ("tpus.tasks.recheck_vm_disks", (scene.vm.pk,))
    assert 3.3 <= countdown <= 3.5
    # The look, when it comes, reconciles the VM once; the beat finds nothing left.
    sent.clear()
    WorkerSync.objects.update(disk_recheck_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        disk_mounts.recheck_vm(scene.vm.pk)
        disk_mounts.recheck_vm(scene.vm.pk)
    assert sent == [("tpus.tasks.reconcile_vm", (scene.vm.pk,), None)]
    assert disk_mounts.due_rechecks() == []


def test_a_new_boot_starts_the_wait_again(scene, mounted):
    worker = scene.vm.workers.get()
    long_ago = (timezone.now() - dt.timedelta(seconds=500)).isoformat()
    _answered(worker, scene.vm.desired_version, waiting_device=["imagenet"])
    WorkerSync.objects.filter(worker=worker).update(
        disk_waits={"boot": "b0", "devices": {"imagenet": long_ago}}
    )

    disk_mounts.after_run(scene.vm.pk, [worker.index])

    sync = WorkerSync.objects.get(worker=worker)
    assert sync.disk_waits["boot"] == "b1"
    assert sync.disk_waits["devices"]["imagenet"] != long_ago
    assert sync.disk_recheck_at is not None


def test_a_mounted_disk_is_shown_as_mounted_and_its_wait_forgotten(scene, mounted, client):
    worker = scene.vm.workers.get()
    _answered(worker, scene.vm.desired_version, waiting_device=["imagenet"])
    disk_mounts.after_run(scene.vm.pk, [worker.index])
    _answered(worker, scene.vm.desired_version)

    disk_mounts.after_run(scene.vm.pk, [worker.index])

    sync = WorkerSync.objects.get(worker=worker)
    assert (sync.disk_waits, sync.disk_recheck_at) == ({}, None)
    client.force_login(scene.admin)
    page = client.get(reverse("vm_detail", args=["vision", scene.vm.pk])).content.decode()
    assert "mounted on every worker" in page


def test_a_reboot_seen_in_a_jobs_status_asks_for_a_reconcile(
    scene, mounted, django_capture_on_commit_callbacks, monkeypatch
):
    asked = []
    monkeypatch.setattr("tpus.queue.reconcile_vm", asked.append)
    worker = scene.vm.workers.get()
    Worker.objects.filter(pk=worker.pk).update(boot_id="b1")
    worker.refresh_from_db()

    disk_mounts.boot_seen(worker, "b1")
    assert asked == []
    disk_mounts.boot_seen(worker, "b2")
    assert asked == [scene.vm.pk]


def test_a_disk_the_workers_never_reached_is_detached_without_waiting(scene):
    # No worker ever answered (host keys not confirmed, say): nothing can be mounted.
    disk = scene.disks["imagenet"]
    inventory.attach_disk(scene.admin, disk, scene.vm, "READ_ONLY")

    operation = _detach(scene, disk)
    disk_operations.run_operation(operation.pk)

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.DONE
    assert _cloud_disks(scene) == []
    assert DataDisk.objects.filter(pk=disk.pk).exists()


def test_the_api_shows_a_detach_waiting_for_the_workers(scene, mounted, client):
    client.force_login(scene.admin)
    response = client.post(
        f"/api/v1/labs/vision/disks/{mounted.pk}/detach",
        {"vm_id": scene.vm.pk},
        content_type="application/json",
    )
    assert response.status_code == 202
    operation = response.json()["id"]
    disk_operations.run_operation(operation)  # as its task does

    polled = client.get(f"/api/v1/labs/vision/disks/{mounted.pk}/operations/{operation}")
    assert (polled.json()["state"], polled.json()["error"]) == ("unmounting", "")
    [listed] = [d for d in client.get("/api/v1/labs/vision/disks").json()["items"]
                if d["name"] == "imagenet"]  # fmt: skip
    assert listed["attachments"] == [{"vm": "tpu1", "mode": "READ_ONLY", "state": "detaching"}]


def test_a_disk_of_a_vm_the_portal_created_is_detached_like_any_other(scene, mounted):
    TpuVm.objects.filter(pk=scene.vm.pk).update(source="created")
    scene.vm.refresh_from_db()

    operation = _detach(scene, mounted)

    assert operation.state == DiskOperationState.UNMOUNTING

"""A disk operation claimed by a worker that died is run again once its lease runs
out; one whose worker is still on it is left alone."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from tpus.models.inventory import DiskAttachment, DiskOperation, DiskOperationState
from tpus.services import disk_operations, inventory
from tpus.tasks import reconcile_sweep

PROJECT = "vision-lab-1"
ZONE = "us-central1-f"


@pytest.fixture
def scene(tpu_emulator, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu5", external_ips=["34.0.0.1"])
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "imagenet")
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    disk = inventory.register_disk(
        admin, lab, name="imagenet", zone=ZONE, size_gb=200, mount_point="/ssd"
    )
    return tpu_emulator, admin, disk, vm


def _running(admin, disk, vm, *, lease_left: float | None) -> DiskOperation:
    """An attach a worker claimed (and then maybe died on)."""
    until = None if lease_left is None else timezone.now() + dt.timedelta(seconds=lease_left)
    return DiskOperation.objects.create(
        disk=disk,
        vm=vm,
        action="attach",
        mode="READ_ONLY",
        requested_by=admin,
        state=DiskOperationState.RUNNING,
        claimed_until=until,
    )


def test_an_operation_whose_worker_died_is_run_again_by_the_sweep(
    scene, django_capture_on_commit_callbacks
):
    emulator, admin, disk, vm = scene
    operation = _running(admin, disk, vm, lease_left=-1)
    # The sweep runs outside any transaction, where queued work goes out at once.
    with django_capture_on_commit_callbacks(execute=True):
        reconcile_sweep()
    operation.refresh_from_db()
    assert operation.state == DiskOperationState.DONE
    assert operation.claimed_until is None
    assert DiskAttachment.objects.filter(disk=disk, vm=vm).exists()
    assert [d.name for d in emulator.client.get_node(PROJECT, ZONE, "tpu5").data_disks] == [
        "imagenet"
    ]


def test_an_operation_with_a_live_lease_is_left_to_its_worker(scene):
    emulator, admin, disk, vm = scene
    operation = _running(admin, disk, vm, lease_left=300)
    assert disk_operations.operations_to_resume() == []
    reconcile_sweep()
    disk_operations.run_operation(operation.pk)  # a duplicate delivery does nothing either
    operation.refresh_from_db()
    assert operation.state == DiskOperationState.RUNNING
    assert not DiskAttachment.objects.filter(disk=disk, vm=vm).exists()
    assert emulator.client.get_node(PROJECT, ZONE, "tpu5").data_disks == ()


def test_a_claim_sets_a_short_lease(scene, settings):
    _, admin, disk, vm = scene
    operation = DiskOperation.objects.create(disk=disk, vm=vm, action="attach", requested_by=admin)
    before = timezone.now()
    assert disk_operations._claim(operation.pk)
    operation.refresh_from_db()
    assert operation.state == DiskOperationState.RUNNING
    lease = (operation.claimed_until - before).total_seconds()
    assert lease == pytest.approx(settings.PORTAL_RECONCILE_CLAIM_SECONDS, abs=2)
    assert not disk_operations._claim(operation.pk)  # the second claim finds it taken


def test_an_operation_whose_worker_stopped_renewing_is_released_at_once(scene):
    _, admin, disk, vm = scene
    lapsed = _running(admin, disk, vm, lease_left=-1)
    assert disk_operations.release_stalled_operations() == [lapsed.pk]


@pytest.mark.django_db(transaction=True)
def test_a_long_step_keeps_its_lease_renewed(make_lab, make_user, settings, monkeypatch):
    import time

    from tpus.models import DataDisk, TpuVm

    settings.PORTAL_RECONCILE_CLAIM_SECONDS = 1
    lab = make_lab()
    vm = TpuVm.objects.create(lab=lab, name="tpu7", zone="us-central1-f", source="imported")
    disk = DataDisk.objects.create(lab=lab, name="data", zone="us-central1-f")
    operation = DiskOperation.objects.create(disk=disk, vm=vm, action="attach")
    seen = {}

    def slow_attach(operation):
        seen["first"] = DiskOperation.objects.get(pk=operation.pk).claimed_until
        time.sleep(2.5)  # a call the API is slow to answer, longer than two leases
        seen["later"] = DiskOperation.objects.get(pk=operation.pk).claimed_until
        seen["stalled"] = disk_operations.release_stalled_operations()
        return True

    monkeypatch.setattr(disk_operations, "_attached", slow_attach)
    disk_operations.run_operation(operation.pk)
    assert seen["later"] > seen["first"] + dt.timedelta(seconds=1)
    assert seen["stalled"] == []
    operation.refresh_from_db()
    assert operation.state == DiskOperationState.DONE and operation.claimed_until is None


def test_a_running_operation_from_before_leases_counts_as_abandoned(scene):
    _, admin, disk, vm = scene
    operation = _running(admin, disk, vm, lease_left=None)
    assert disk_operations.operations_to_resume() == [operation.pk]


def test_a_waiting_operation_whose_task_was_lost_is_resumed_and_a_fresh_one_is_not(scene, settings):
    _, admin, disk, vm = scene
    long_ago = timezone.now() - dt.timedelta(seconds=settings.PORTAL_RECONCILE_SWEEP_SECONDS + 1)
    old = DiskOperation.objects.create(
        disk=disk, vm=vm, action="attach", requested_by=admin, created_at=long_ago
    )
    DiskOperation.objects.create(disk=disk, vm=vm, action="detach", requested_by=admin)
    assert disk_operations.operations_to_resume() == [old.pk]


def test_finished_operations_are_never_run_again(scene):
    _, admin, disk, vm = scene
    for state in (DiskOperationState.DONE, DiskOperationState.FAILED):
        DiskOperation.objects.create(
            disk=disk, vm=vm, action="attach", requested_by=admin, state=state,
            claimed_until=timezone.now() - dt.timedelta(hours=1),
        )  # fmt: skip
    assert disk_operations.operations_to_resume() == []


RUN = "tpus.tasks.run_disk_operation"


def _asked(admin, disk, vm, action, django_capture_on_commit_callbacks) -> DiskOperation:
    with django_capture_on_commit_callbacks(execute=True):
        return disk_operations.request_operation(admin, disk, vm, action)


def _follow(operation, queued, django_capture_on_commit_callbacks) -> list[float]:
    """Run the operation's steps as a worker would, each look when it is due; the
    seconds each step took."""
    import time

    took = []
    while True:
        started = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True):
            disk_operations.run_operation(operation.pk)
        took.append(time.monotonic() - started)
        operation.refresh_from_db()
        if operation.state not in (DiskOperationState.RUNNING, DiskOperationState.UNMOUNTING):
            return took
        looks = queued.take(RUN)
        if operation.state == DiskOperationState.UNMOUNTING:
            continue  # the workers' reconcile hands it on (none was ever reached here)
        # Underway at Google: nobody holds the operation until the next look is due,
        # and that look is queued for then; no sweep takes it for a dead worker's.
        [(args, countdown)] = looks
        assert args == (operation.pk,) and operation.cloud_operation and countdown >= 1
        left = (operation.claimed_until - timezone.now()).total_seconds()
        assert 0 < left <= countdown
        assert disk_operations.release_stalled_operations() == []
        time.sleep(countdown)


def test_an_attach_sends_the_change_and_looks_again_later_instead_of_waiting(
    scene, django_capture_on_commit_callbacks, queued_tasks
):
    emulator, admin, disk, vm = scene
    emulator.operation_delay = 2.0  # Google takes its time
    queued = queued_tasks
    operation = _asked(admin, disk, vm, "attach", django_capture_on_commit_callbacks)
    assert queued.take(RUN) == [((operation.pk,), None)]

    took = _follow(operation, queued, django_capture_on_commit_callbacks)

    assert max(took) < 1.0, took
    assert len(took) >= 2
    assert operation.state == DiskOperationState.DONE, operation.error
    assert operation.claimed_until is None
    assert DiskAttachment.objects.filter(disk=disk, vm=vm).exists()
    assert emulator.requests["GetOperation"] >= 1


def test_a_detach_looks_at_the_api_the_same_way(
    scene, django_capture_on_commit_callbacks, queued_tasks
):
    emulator, admin, disk, vm = scene
    inventory.attach_disk(admin, disk, vm, "READ_ONLY")
    emulator.operation_delay = 2.0
    queued = queued_tasks
    operation = _asked(admin, disk, vm, "detach", django_capture_on_commit_callbacks)
    queued.take(RUN)

    took = _follow(operation, queued, django_capture_on_commit_callbacks)

    assert max(took) < 1.0, took
    assert operation.state == DiskOperationState.DONE, operation.error
    assert not DiskAttachment.objects.filter(disk=disk, vm=vm).exists()
    assert emulator.client.get_node(PROJECT, ZONE, "tpu5").data_disks == ()


def test_an_operation_google_does_not_finish_in_time_fails_as_before(
    scene, django_capture_on_commit_callbacks, queued_tasks, settings
):
    import time

    emulator, admin, disk, vm = scene
    settings.TPU_API_OPERATION_TIMEOUT = 1
    emulator.operation_delay = 30.0
    operation = _asked(admin, disk, vm, "attach", django_capture_on_commit_callbacks)
    disk_operations.run_operation(operation.pk)
    time.sleep(1.1)
    DiskOperation.objects.filter(pk=operation.pk).update(claimed_until=timezone.now())

    disk_operations.run_operation(operation.pk)

    operation.refresh_from_db()
    assert operation.state == DiskOperationState.FAILED
    assert operation.error == (
        "The Cloud TPU API refused: Cloud TPU API UpdateNode failed: DEADLINE_EXCEEDED: the "
        "operation did not finish in time (the Cloud TPU API did not answer in time; try "
        "again later)"
    )
    assert not DiskAttachment.objects.filter(disk=disk, vm=vm).exists()

"""Attaching and detaching data disks: v2alpha1 UpdateNode with mask data_disks, waited
on as a long-running operation, against the emulator."""

from __future__ import annotations

import pytest

from tpus.cloud import CloudError, DiskInfo

PROJECT = "lab-project"
ZONE = "us-central2-b"
DISK = f"projects/{PROJECT}/zones/{ZONE}/disks/imagenet"


@pytest.fixture
def two_vms(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu2")
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "imagenet", size_gb=500)
    # Finish operations a little later so the client really polls GetOperation.
    tpu_emulator.operation_delay = 0.05
    return tpu_emulator


def test_a_read_only_disk_attaches_to_two_vms(two_vms):
    client = two_vms.client

    first = client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")
    second = client.attach_disk(PROJECT, ZONE, "tpu2", DISK, "READ_ONLY")

    assert first.data_disks == (DiskInfo(DISK, "READ_ONLY"),)
    assert second.data_disks == (DiskInfo(DISK, "READ_ONLY"),)
    assert client.get_node(PROJECT, ZONE, "tpu1").data_disks[0].name == "imagenet"
    assert client.calls["UpdateNode"] == 2
    assert two_vms.requests["GetOperation"] >= 2  # the operations were polled to the end


def test_a_read_write_disk_in_use_is_refused_on_a_second_vm(two_vms):
    client = two_vms.client
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_WRITE")

    with pytest.raises(CloudError) as caught:
        client.attach_disk(PROJECT, ZONE, "tpu2", "imagenet", "READ_WRITE")

    assert (caught.value.code, caught.value.retryable) == ("FAILED_PRECONDITION", False)
    assert "tpu1" in str(caught.value)
    assert client.get_node(PROJECT, ZONE, "tpu2").data_disks == ()


def test_a_disk_read_only_elsewhere_cannot_be_attached_read_write(two_vms):
    client = two_vms.client
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    with pytest.raises(CloudError) as caught:
        client.attach_disk(PROJECT, ZONE, "tpu2", "imagenet", "READ_WRITE")

    assert caught.value.code == "FAILED_PRECONDITION"


def test_attaching_an_attached_disk_again_changes_nothing(two_vms):
    client = two_vms.client
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    again = client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    assert again.data_disks == (DiskInfo(DISK, "READ_ONLY"),)
    assert client.calls["UpdateNode"] == 1


def test_attaching_in_another_mode_asks_for_a_detach_first(two_vms):
    client = two_vms.client
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    with pytest.raises(CloudError) as caught:
        client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_WRITE")

    assert caught.value.code == "FAILED_PRECONDITION"
    assert "detach" in str(caught.value)


def test_detaching_keeps_the_other_disks_and_is_idempotent(two_vms):
    client = two_vms.client
    two_vms.controls.add_disk(PROJECT, ZONE, "scratch")
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet")
    client.attach_disk(PROJECT, ZONE, "tpu1", "scratch", "READ_WRITE")

    after = client.detach_disk(PROJECT, ZONE, "tpu1", "imagenet")
    again = client.detach_disk(PROJECT, ZONE, "tpu1", "imagenet")

    expected = (DiskInfo(f"projects/{PROJECT}/zones/{ZONE}/disks/scratch", "READ_WRITE"),)
    assert after.data_disks == expected
    assert again.data_disks == expected
    assert client.calls["UpdateNode"] == 3


def test_a_detached_read_write_disk_can_move_to_another_vm(two_vms):
    client = two_vms.client
    client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_WRITE")
    client.detach_disk(PROJECT, ZONE, "tpu1", "imagenet")

    moved = client.attach_disk(PROJECT, ZONE, "tpu2", "imagenet", "READ_WRITE")

    assert moved.data_disks == (DiskInfo(DISK, "READ_WRITE"),)


def test_an_unknown_disk_is_not_found(two_vms):
    with pytest.raises(CloudError) as caught:
        two_vms.client.attach_disk(PROJECT, ZONE, "tpu1", "no-such-disk")

    assert (caught.value.code, caught.value.retryable) == ("NOT_FOUND", False)


def test_an_unknown_mode_is_a_programming_error(two_vms):
    with pytest.raises(ValueError):
        two_vms.client.attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "rw")


def test_an_attach_can_be_sent_and_looked_at_later_without_waiting(two_vms):
    import time

    client = two_vms.client
    two_vms.operation_delay = 0.5

    started = client.begin_attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    assert started.node is None and started.operation
    assert not client.look_at_operation(started.operation, waited=0, method="UpdateNode").done
    time.sleep(0.6)
    looked = client.look_at_operation(started.operation, waited=0.6, method="UpdateNode")
    node = looked.node
    assert looked.done and node.data_disks == (DiskInfo(DISK, "READ_ONLY"),)
    # Attached already: nothing is sent, and the node comes back at once.
    again = client.begin_attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")
    assert again.node.data_disks == node.data_disks and not again.operation
    assert client.calls["UpdateNode"] == 1


def test_an_operation_still_running_after_the_operation_timeout_is_an_error(two_vms):
    client = two_vms.client
    two_vms.operation_delay = 30
    started = client.begin_detach_disk(PROJECT, ZONE, "tpu1", "imagenet")
    assert started.done and started.node is not None  # not attached: nothing to do
    started = client.begin_attach_disk(PROJECT, ZONE, "tpu1", "imagenet", "READ_ONLY")

    with pytest.raises(CloudError) as caught:
        client.look_at_operation(
            started.operation, waited=client.config.operation_timeout, method="UpdateNode"
        )

    assert caught.value.code == "DEADLINE_EXCEEDED"
    assert "the operation did not finish in time" in str(caught.value)

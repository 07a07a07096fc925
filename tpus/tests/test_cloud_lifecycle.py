"""Making and ending TPU VMs through the portal's one door to the Cloud TPU API, against
the emulator: CreateNode (a stockout is a retryable RESOURCE_EXHAUSTED), queued
resources and their states, stop/start/delete, and what a zone offers."""

from __future__ import annotations

import datetime as dt

import pytest

from tpus.cloud import CloudError, NodeRequest

PROJECT = "lab-project"
ZONE = "us-central2-b"
LAB_KEY = "tpu-portal:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCLJb2kSmDk tpu-portal"


def wanted(**fields) -> NodeRequest:
    values = dict(
        name="tpu5",
        zone=ZONE,
        accelerator_type="v4-32",
        runtime_version="tpu-ubuntu2204-base",
        metadata={"ssh-keys": LAB_KEY},
    )
    values.update(fields)
    return NodeRequest(**values)


def test_a_node_is_created_with_the_lab_key_in_its_metadata(tpu_emulator):
    tpu_emulator.operation_delay = 0.05
    node = tpu_emulator.client.create_node(PROJECT, wanted(provisioning="spot"))
    assert (node.name, node.state, node.spot, len(node.workers)) == ("tpu5", "READY", True, 4)
    assert tpu_emulator.client.node_metadata(PROJECT, ZONE, "tpu5")["ssh-keys"] == LAB_KEY
    assert tpu_emulator.requests["GetOperation"] >= 1


def test_a_node_is_created_with_its_data_disks_and_an_unknown_disk_makes_nothing(tpu_emulator):
    client = tpu_emulator.client
    scratch = tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    data = tpu_emulator.controls.add_disk(PROJECT, ZONE, "data")
    disks = ((scratch, "READ_ONLY"), (data, "READ_WRITE"))
    node = client.create_node(
        PROJECT, wanted(name="tpu6", accelerator_type="v4-8", data_disks=disks)
    )
    assert [(d.source_disk, d.mode) for d in node.data_disks] == list(disks)
    assert client.get_node(PROJECT, ZONE, "tpu6").data_disks == node.data_disks

    missing = f"projects/{PROJECT}/zones/{ZONE}/disks/nowhere"
    with pytest.raises(CloudError) as refused:
        client.create_node(PROJECT, wanted(name="tpu7", data_disks=((missing, "READ_ONLY"),)))
    assert refused.value.code == "NOT_FOUND"
    # A read-write disk another node holds is refused too.
    with pytest.raises(CloudError) as refused:
        client.create_node(PROJECT, wanted(name="tpu7", data_disks=((data, "READ_ONLY"),)))
    assert refused.value.code == "FAILED_PRECONDITION"
    assert [n.name for n in client.list_nodes(PROJECT, ZONE)] == ["tpu6"]


def test_a_stockout_is_a_retryable_refusal_and_makes_nothing(tpu_emulator):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    with pytest.raises(CloudError) as refused:
        tpu_emulator.client.create_node(PROJECT, wanted())
    assert refused.value.code == "RESOURCE_EXHAUSTED" and refused.value.retryable
    assert "no more capacity" in str(refused.value)
    assert tpu_emulator.client.list_nodes(PROJECT, ZONE) == []


def test_a_queued_request_is_followed_from_waiting_to_active(tpu_emulator):
    client = tpu_emulator.client
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    until = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    accepted = client.create_queued_resource(
        PROJECT, "tpu5-1", wanted(provisioning="spot", valid_until=until)
    )
    assert (accepted.name, accepted.node_id, accepted.state) == ("tpu5-1", "tpu5", "ACCEPTED")
    assert accepted.provisioning == "spot"
    assert accepted.valid_until is not None and abs(accepted.valid_until - until).seconds < 1

    assert client.get_queued_resource(PROJECT, ZONE, "tpu5-1").state == "WAITING_FOR_RESOURCES"
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    assert client.get_queued_resource(PROJECT, ZONE, "tpu5-1").state == "PROVISIONING"
    assert client.get_node(PROJECT, ZONE, "tpu5").state == "READY"
    [listed] = client.list_queued_resources(PROJECT, ZONE)
    assert listed.state == "ACTIVE"


def test_a_failed_request_says_why(tpu_emulator):
    client = tpu_emulator.client
    client.create_queued_resource(PROJECT, "bad", wanted(runtime_version="no-such-version"))
    failed = client.get_queued_resource(PROJECT, ZONE, "bad")
    assert failed.state == "FAILED"
    assert failed.error_code == "INVALID_ARGUMENT"
    assert "no-such-version" in failed.error_message


def test_a_preempted_request_is_suspended_and_reset_brings_it_back(tpu_emulator):
    client = tpu_emulator.client
    client.create_queued_resource(PROJECT, "tpu5-1", wanted(provisioning="spot"))
    client.get_queued_resource(PROJECT, ZONE, "tpu5-1")
    tpu_emulator.controls.preempt("tpu5")
    suspended = client.get_queued_resource(PROJECT, ZONE, "tpu5-1")
    assert (suspended.state, suspended.initiated_by) == ("SUSPENDED", "SERVICE")
    assert client.reset_queued_resource(PROJECT, ZONE, "tpu5-1").state == "PROVISIONING"
    assert client.get_node(PROJECT, ZONE, "tpu5").state == "READY"


def test_a_request_is_cancelled_and_with_its_node_deleted(tpu_emulator):
    client = tpu_emulator.client
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    client.create_queued_resource(PROJECT, "waiting", wanted())
    client.delete_queued_resource(PROJECT, ZONE, "waiting")
    assert client.list_queued_resources(PROJECT, ZONE) == []

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    client.create_queued_resource(PROJECT, "up", wanted(name="tpu6"))
    client.get_queued_resource(PROJECT, ZONE, "up")
    with pytest.raises(CloudError) as refused:
        client.delete_queued_resource(PROJECT, ZONE, "up")
    assert refused.value.code == "FAILED_PRECONDITION"
    client.delete_queued_resource(PROJECT, ZONE, "up", with_node=True)
    assert client.list_nodes(PROJECT, ZONE) == []


def test_stop_start_and_delete(tpu_emulator):
    client = tpu_emulator.client
    client.create_node(PROJECT, wanted(accelerator_type="v4-8"))
    assert client.stop_node(PROJECT, ZONE, "tpu5").state == "STOPPED"
    assert client.start_node(PROJECT, ZONE, "tpu5").state == "READY"
    client.delete_node(PROJECT, ZONE, "tpu5")
    with pytest.raises(CloudError) as gone:
        client.get_node(PROJECT, ZONE, "tpu5")
    assert gone.value.code == "NOT_FOUND"


def test_a_zone_lists_its_accelerator_types_and_runtime_versions(tpu_emulator):
    assert "v4-32" in tpu_emulator.client.accelerator_types(PROJECT, ZONE)
    assert "tpu-ubuntu2204-base" in tpu_emulator.client.runtime_versions(PROJECT, ZONE)


def test_a_node_call_can_be_sent_and_looked_at_later_without_waiting(tpu_emulator):
    import time

    client = tpu_emulator.client
    tpu_emulator.operation_delay = 0.5

    started = client.begin_create_node(PROJECT, wanted(accelerator_type="v4-8"))
    assert not started.done
    assert not client.look_at_operation(started.operation, waited=0, method="CreateNode").done
    time.sleep(0.6)
    made = client.look_at_operation(started.operation, waited=0.6, method="CreateNode")
    assert made.done and (made.node.name, made.node.state) == ("tpu5", "READY")

    stopping = client.begin_stop_node(PROJECT, ZONE, "tpu5")
    time.sleep(0.6)
    stopped = client.look_at_operation(stopping.operation, waited=0.6, method="StopNode")
    assert stopped.node.state == "STOPPED"
    deleting = client.begin_delete_node(PROJECT, ZONE, "tpu5")
    time.sleep(0.6)
    deleted = client.look_at_operation(deleting.operation, waited=0.6, method="DeleteNode")
    assert deleted.done and deleted.node is None
    with pytest.raises(CloudError) as gone:
        client.begin_delete_node(PROJECT, ZONE, "tpu5")
    assert gone.value.code == "NOT_FOUND"

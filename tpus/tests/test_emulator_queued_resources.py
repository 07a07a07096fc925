"""Capacity and queued resources in the emulator, as the unmodified google-cloud-tpu
client sees them over a real channel: a stockout refuses CreateNode, a queued resource
waits for capacity and comes up with its node, a preempted spot node suspends its
request, and a reset brings it back as a new node."""

from __future__ import annotations

import datetime as dt

import grpc
import pytest
from google.api_core import exceptions as api_exceptions
from google.api_core.future import polling
from google.cloud import tpu_v2
from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

PROJECT = "lab-project"
ZONE = "us-central2-b"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
FAST = polling.DEFAULT_POLLING.with_delay(initial=0.01, maximum=0.05).with_timeout(10)
State = tpu_v2.QueuedResourceState.State


@pytest.fixture
def v2(tpu_emulator):
    channel = grpc.insecure_channel(tpu_emulator.endpoint, options=[("grpc.enable_http_proxy", 0)])
    yield tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel))
    channel.close()


def request_for(node_id: str = "tpu5", *, accelerator_type: str = "v4-32", **fields):
    node = tpu_v2.Node(
        accelerator_type=accelerator_type,
        runtime_version=fields.pop("runtime_version", "tpu-ubuntu2204-base"),
        metadata=fields.pop("metadata", {}),
    )
    return tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(
            node_spec=[
                tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, node_id=node_id, node=node)
            ]
        ),
        **fields,
    )


def queue(v2, resource_id: str = "tpu5-request", **fields):
    operation = v2.create_queued_resource(
        parent=PARENT, queued_resource_id=resource_id, queued_resource=request_for(**fields)
    )
    return operation.result(polling=FAST)


def state_of(v2, resource_id: str = "tpu5-request"):
    return v2.get_queued_resource(name=f"{PARENT}/queuedResources/{resource_id}").state


def test_a_stockout_refuses_create_node_with_googles_words_and_creates_nothing(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    with pytest.raises(api_exceptions.ResourceExhausted) as refused:
        v2.create_node(parent=PARENT, node_id="tpu5", node=tpu_v2.Node(accelerator_type="v4-32"))
    assert f'There is no more capacity in the zone "{ZONE}"' in str(refused.value)
    assert list(v2.list_nodes(parent=PARENT)) == []
    # Another type in the same zone is not stocked out.
    v2.create_node(
        parent=PARENT, node_id="small", node=tpu_v2.Node(accelerator_type="v4-8")
    ).result(polling=FAST)


def test_a_queued_spot_request_waits_for_capacity_then_comes_up_with_its_node(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    keys = "tpu-portal:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBx lab-key"
    accepted = queue(v2, spot=tpu_v2.QueuedResource.Spot(), metadata={"ssh-keys": keys})
    assert accepted.state.state == State.ACCEPTED
    assert "spot" in accepted

    assert state_of(v2).state == State.WAITING_FOR_RESOURCES
    assert list(v2.list_nodes(parent=PARENT)) == []

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    assert state_of(v2).state == State.PROVISIONING
    node = v2.get_node(name=f"{PARENT}/nodes/tpu5")
    assert node.state == tpu_v2.Node.State.READY
    assert len(node.network_endpoints) == 4
    assert node.metadata["ssh-keys"] == keys  # created with the lab's key in place
    assert node.scheduling_config.spot
    assert state_of(v2).state == State.ACTIVE


def test_requests_are_provisioned_in_the_order_they_came(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    queue(v2, "first", node_id="tpu5")
    queue(v2, "second", node_id="tpu6")
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 1)
    assert state_of(v2, "first").state == State.PROVISIONING
    assert state_of(v2, "second").state == State.WAITING_FOR_RESOURCES


def test_a_request_still_waiting_at_the_end_of_its_window_fails(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=200)
    queue(v2, queueing_policy=tpu_v2.QueuedResource.QueueingPolicy(valid_until_time=soon))
    assert state_of(v2).state == State.WAITING_FOR_RESOURCES
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=10)
    while state_of(v2).state != State.FAILED and dt.datetime.now(dt.UTC) < deadline:
        pass
    failed = state_of(v2)
    assert failed.state == State.FAILED
    assert failed.failed_data.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "valid_until" in failed.failed_data.error.message


def test_a_bad_runtime_version_fails_the_request_with_the_reason(v2):
    queue(v2, runtime_version="tpu-no-such-version")
    failed = state_of(v2)
    assert failed.state == State.FAILED
    assert failed.failed_data.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "tpu-no-such-version" in failed.failed_data.error.message


def test_a_request_failed_by_the_service_says_why(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    queue(v2)
    tpu_emulator.controls.fail_request(
        "tpu5-request", "RESOURCE_EXHAUSTED", "Quota 'TPUV4sPodPerProjectPerZone' exceeded."
    )
    failed = state_of(v2)
    assert failed.state == State.FAILED
    assert failed.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
    assert "Quota" in failed.failed_data.error.message


def test_a_preempted_spot_node_suspends_its_request_and_a_reset_brings_a_new_one(tpu_emulator, v2):
    queue(v2, spot=tpu_v2.QueuedResource.Spot())
    state_of(v2)  # provisioned
    before = v2.get_node(name=f"{PARENT}/nodes/tpu5")
    keys_before = tpu_emulator.controls.show()["nodes"][before.name]["workers"][0]["host_keys"]

    tpu_emulator.controls.preempt("tpu5")
    suspended = state_of(v2)
    assert suspended.state == State.SUSPENDED
    assert suspended.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
    assert v2.get_node(name=before.name).state == tpu_v2.Node.State.PREEMPTED

    reset = v2.reset_queued_resource(name=f"{PARENT}/queuedResources/tpu5-request")
    assert reset.result(polling=FAST).state.state == State.PROVISIONING
    after = v2.get_node(name=before.name)
    assert after.state == tpu_v2.Node.State.READY
    assert after.id != before.id
    keys_after = tpu_emulator.controls.show()["nodes"][after.name]["workers"][0]["host_keys"]
    assert keys_after != keys_before  # a re-created VM has new host keys


def test_a_request_with_a_node_is_deleted_only_with_force_and_takes_the_node(v2):
    queue(v2)
    state_of(v2)
    name = f"{PARENT}/queuedResources/tpu5-request"
    with pytest.raises(api_exceptions.FailedPrecondition):
        v2.delete_queued_resource(request={"name": name}).result(polling=FAST)
    v2.delete_queued_resource(request={"name": name, "force": True}).result(polling=FAST)
    with pytest.raises(api_exceptions.NotFound):
        v2.get_queued_resource(name=name)
    with pytest.raises(api_exceptions.NotFound):
        v2.get_node(name=f"{PARENT}/nodes/tpu5")


def test_queued_resources_are_listed_a_page_at_a_time(tpu_emulator, v2):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    for n in range(3):
        queue(v2, f"r{n}", node_id=f"tpu{n}")
    first = v2.list_queued_resources(request={"parent": PARENT, "page_size": 2})
    assert [r.name.rsplit("/", 1)[-1] for r in first.queued_resources] == ["r0", "r1"]
    everything = v2.list_queued_resources(request={"parent": PARENT, "page_size": 2})
    assert [r.name.rsplit("/", 1)[-1] for r in everything] == ["r0", "r1", "r2"]


def test_a_second_request_for_the_same_name_or_node_is_already_exists(v2):
    queue(v2)
    with pytest.raises(api_exceptions.AlreadyExists):
        queue(v2)
    with pytest.raises(api_exceptions.AlreadyExists):
        queue(v2, "other-request")  # its node, tpu5, exists by now

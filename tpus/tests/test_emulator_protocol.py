"""The emulator as the unmodified google-cloud-tpu client sees it, over a real channel."""

from __future__ import annotations

import grpc
import pytest
from google.api_core import exceptions as api_exceptions
from google.api_core.future import polling
from google.cloud import tpu_v2, tpu_v2alpha1
from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport
from google.cloud.tpu_v2alpha1.services.tpu.transports import (
    TpuGrpcTransport as AlphaTpuGrpcTransport,
)

PROJECT = "lab-project"
ZONE = "us-central2-b"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
FAST = polling.DEFAULT_POLLING.with_delay(initial=0.01, maximum=0.05).with_timeout(10)


@pytest.fixture
def channel(tpu_emulator):
    channel = grpc.insecure_channel(tpu_emulator.endpoint, options=[("grpc.enable_http_proxy", 0)])
    yield channel
    channel.close()


@pytest.fixture
def v2(channel):
    return tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel))


@pytest.fixture
def alpha(channel):
    return tpu_v2alpha1.TpuClient(transport=AlphaTpuGrpcTransport(channel=channel))


def test_pages_never_exceed_the_page_size_asked_for(tpu_emulator, v2):
    with tpu_emulator.controls.batch():
        for i in range(250):
            tpu_emulator.controls.add_node(PROJECT, ZONE, f"n{i:03d}", workers=1)

    pages = list(v2.list_nodes(request={"parent": PARENT, "page_size": 100}).pages)

    assert [len(page.nodes) for page in pages] == [100, 100, 50]
    assert pages[-1].next_page_token == ""
    names = [node.name for page in pages for node in page.nodes]
    assert names == sorted(set(names))


def test_a_bad_page_token_is_an_invalid_argument(tpu_emulator, v2):
    with pytest.raises(api_exceptions.InvalidArgument):
        v2.list_nodes(request={"parent": PARENT, "page_token": "%%%"})


def test_a_node_deleted_between_pages_does_not_shift_the_next_page(tpu_emulator, v2):
    with tpu_emulator.controls.batch():
        for i in range(4):
            tpu_emulator.controls.add_node(PROJECT, ZONE, f"n{i}", workers=1)
    first = v2.list_nodes(request={"parent": PARENT, "page_size": 2})

    tpu_emulator.controls.delete("n0")
    rest = v2.list_nodes(
        request={"parent": PARENT, "page_size": 2, "page_token": first.next_page_token}
    )

    assert [n.name.rsplit("/", 1)[-1] for n in rest.nodes] == ["n2", "n3"]


def test_create_node_finishes_through_get_operation(tpu_emulator, v2):
    tpu_emulator.operation_delay = 0.05
    operation = v2.create_node(
        parent=PARENT,
        node_id="fresh",
        node=tpu_v2.Node(accelerator_type="v4-32", runtime_version="tpu-ubuntu2204-base"),
    )

    node = operation.result(polling=FAST)

    assert node.name == f"{PARENT}/nodes/fresh"
    assert node.state == tpu_v2.Node.State.READY
    assert len(node.network_endpoints) == 4
    assert operation.metadata.verb == "create"
    assert tpu_emulator.requests["GetOperation"] >= 1


def test_creating_an_existing_node_is_already_exists(tpu_emulator, v2):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "taken")

    with pytest.raises(api_exceptions.AlreadyExists):
        v2.create_node(parent=PARENT, node_id="taken", node=tpu_v2.Node(accelerator_type="v4-8"))


def test_stop_start_and_delete_run_as_operations(tpu_emulator, v2):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "vm", workers=1, external_ips=["203.0.113.9"])
    name = f"{PARENT}/nodes/vm"

    stopped = v2.stop_node(request={"name": name}).result(polling=FAST)
    started = v2.start_node(request={"name": name}).result(polling=FAST)
    v2.delete_node(request={"name": name}).result(polling=FAST)

    assert stopped.state == tpu_v2.Node.State.STOPPED
    assert stopped.network_endpoints[0].access_config.external_ip == ""
    assert started.state == tpu_v2.Node.State.READY
    assert started.network_endpoints[0].access_config.external_ip not in ("", "203.0.113.9")
    with pytest.raises(api_exceptions.NotFound):
        v2.get_node(name=name)


def test_v2_updates_labels_but_not_data_disks(tpu_emulator, v2):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "vm")
    name = f"{PARENT}/nodes/vm"

    updated = v2.update_node(
        node=tpu_v2.Node(name=name, labels={"owner": "milo"}), update_mask={"paths": ["labels"]}
    ).result(polling=FAST)

    assert dict(updated.labels) == {"owner": "milo"}
    with pytest.raises(api_exceptions.InvalidArgument):
        v2.update_node(node=tpu_v2.Node(name=name), update_mask={"paths": ["data_disks"]})


def test_alpha_update_node_attaches_a_disk(tpu_emulator, alpha):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "vm")
    disk = tpu_emulator.controls.add_disk(PROJECT, ZONE, "data")
    node = tpu_v2alpha1.Node(
        name=f"{PARENT}/nodes/vm",
        data_disks=[tpu_v2alpha1.AttachedDisk(source_disk=disk, mode="READ_ONLY")],
    )

    result = alpha.update_node(node=node, update_mask={"paths": ["data_disks"]}).result(
        polling=FAST
    )

    assert result.data_disks[0].source_disk == disk
    assert result.data_disks[0].mode == tpu_v2alpha1.AttachedDisk.DiskMode.READ_ONLY


def test_guest_attributes_answer_one_entry_per_worker(tpu_emulator, v2):
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "pod", workers=2, host_keys={0: {"ssh-ed25519": "AAAA0"}, 1: {}}
    )

    response = v2.get_guest_attributes(
        request={"name": f"{PARENT}/nodes/pod", "query_path": "hostkeys/"}
    )

    assert len(response.guest_attributes) == 2
    entries = [
        [(i.namespace, i.key, i.value) for i in attrs.query_value.items]
        for attrs in response.guest_attributes
    ]
    assert entries[0] == [("hostkeys", "ssh-ed25519", "AAAA0")]
    assert len(entries[1]) == 1  # worker 1 got a generated key


def test_accelerator_types_and_runtime_versions_are_listed(v2):
    types = [t.type_ for t in v2.list_accelerator_types(parent=PARENT)]
    versions = [v.version for v in v2.list_runtime_versions(parent=PARENT)]

    assert "v4-32" in types
    assert "tpu-ubuntu2204-base" in versions


def test_calls_the_emulator_does_not_implement_answer_unimplemented(v2):
    with pytest.raises(api_exceptions.MethodNotImplemented):
        v2.generate_service_identity(request={"parent": PARENT})


def test_an_unknown_operation_is_not_found(v2):
    from google.longrunning import operations_pb2

    with pytest.raises(api_exceptions.NotFound):
        v2.get_operation(operations_pb2.GetOperationRequest(name=f"{PARENT}/operations/nope"))


def test_an_injected_fault_can_target_one_method(tpu_emulator, v2):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "vm")
    tpu_emulator.controls.fail(1, "INTERNAL", method="GetNode")

    v2.list_nodes(parent=PARENT)  # not the targeted method
    with pytest.raises(api_exceptions.InternalServerError):
        v2.get_node(name=f"{PARENT}/nodes/vm")
    assert v2.get_node(name=f"{PARENT}/nodes/vm").name.endswith("/vm")

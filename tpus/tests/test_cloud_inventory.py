"""Reading a lab's TPU VMs through tpus.cloud, against the emulator over real gRPC."""

from __future__ import annotations

from datetime import datetime

from tpus.cloud import GuestHostKeys, NodeInfo, WorkerInfo, cloud_tpu
from tpus.emulator.controls import new_host_key

PROJECT = "lab-project"
ZONE = "us-central2-b"


def test_it_lists_1200_nodes_a_page_at_a_time(tpu_emulator):
    with tpu_emulator.controls.batch():
        for i in range(1200):
            tpu_emulator.controls.add_node(PROJECT, ZONE, f"tpu{i:04d}", workers=1)

    nodes = tpu_emulator.client.list_nodes(PROJECT, ZONE, page_size=100)

    assert len(nodes) == 1200
    assert len({n.name for n in nodes}) == 1200
    assert tpu_emulator.client.calls["ListNodes"] == 12
    assert tpu_emulator.requests["ListNodes"] == 12


def test_the_default_page_size_needs_few_calls(tpu_emulator):
    with tpu_emulator.controls.batch():
        for i in range(1200):
            tpu_emulator.controls.add_node(PROJECT, ZONE, f"tpu{i:04d}", workers=1)

    assert len(tpu_emulator.client.list_nodes(PROJECT, ZONE)) == 1200
    assert tpu_emulator.client.calls["ListNodes"] == 3  # pages of 500


def test_500_nodes_in_5_zones_take_exactly_5_list_calls(tpu_emulator):
    zones = [f"us-central{i}-a" for i in range(1, 6)]
    with tpu_emulator.controls.batch():
        for zone in zones:
            for i in range(100):
                tpu_emulator.controls.add_node(PROJECT, zone, f"tpu{i}", workers=1)
    client = tpu_emulator.client

    seen = [node for zone in zones for node in client.list_nodes(PROJECT, zone)]

    assert len(seen) == 500
    assert sum(client.calls.values()) == 5
    assert client.calls == {"ListNodes": 5}
    assert tpu_emulator.requests["ListNodes"] == 5


def test_listing_a_zone_returns_only_that_zone(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "here")
    tpu_emulator.controls.add_node(PROJECT, "europe-west4-a", "elsewhere")
    tpu_emulator.controls.add_node("other-project", ZONE, "theirs")

    names = [n.name for n in tpu_emulator.client.list_nodes(PROJECT, ZONE)]

    assert names == ["here"]


def test_a_four_worker_pod_reports_each_workers_addresses(tpu_emulator):
    tpu_emulator.controls.add_node(
        PROJECT,
        ZONE,
        "pod",
        accelerator_type="v4-32",
        internal_ips=["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"],
        external_ips=["203.0.113.10", "203.0.113.11", "203.0.113.12", "203.0.113.13"],
        labels={"team": "vision"},
        runtime_version="tpu-ubuntu2204-base",
    )

    node = tpu_emulator.client.get_node(PROJECT, ZONE, "pod")

    assert isinstance(node, NodeInfo)
    assert node.name == "pod"
    assert node.zone == ZONE
    assert node.project == PROJECT
    assert node.resource_name == f"projects/{PROJECT}/locations/{ZONE}/nodes/pod"
    assert (node.state, node.health) == ("READY", "HEALTHY")
    assert (node.accelerator_type, node.topology) == ("v4-32", "2x2x4")
    assert node.runtime_version == "tpu-ubuntu2204-base"
    assert node.labels == {"team": "vision"}
    assert isinstance(node.create_time, datetime) and type(node.create_time) is datetime
    assert node.workers == (
        WorkerInfo(0, "10.0.0.10", "203.0.113.10"),
        WorkerInfo(1, "10.0.0.11", "203.0.113.11"),
        WorkerInfo(2, "10.0.0.12", "203.0.113.12"),
        WorkerInfo(3, "10.0.0.13", "203.0.113.13"),
    )


def test_a_maintenance_event_shows_as_unhealthy_without_external_ips(tpu_emulator):
    controls = tpu_emulator.controls
    controls.add_node(PROJECT, ZONE, "tpu5", accelerator_type="v4-16", workers=2)

    controls.maintenance("tpu5")
    during = tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5")
    controls.end_maintenance("tpu5", ["203.0.113.50", "203.0.113.51"])
    after = tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5")

    assert during.health == "UNHEALTHY_MAINTENANCE"
    assert [w.external_ip for w in during.workers] == [None, None]
    assert (after.state, after.health) == ("READY", "HEALTHY")
    assert [w.external_ip for w in after.workers] == ["203.0.113.50", "203.0.113.51"]


def test_a_preempted_node_reports_preempted(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "spot1", spot=True)
    tpu_emulator.controls.preempt("spot1")

    node = tpu_emulator.client.get_node(PROJECT, ZONE, "spot1")

    assert node.state == "PREEMPTED"
    assert node.spot is True
    assert node.workers[0].external_ip is None


def test_host_keys_come_per_worker_from_guest_attributes(tpu_emulator):
    keys = {i: new_host_key() for i in range(4)}
    tpu_emulator.controls.add_node(
        PROJECT,
        ZONE,
        "pod",
        accelerator_type="v4-32",
        host_keys={i: {"ssh-ed25519": key} for i, key in keys.items()},
    )

    found = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "pod")

    assert isinstance(found, GuestHostKeys)
    assert sorted(found.workers) == [0, 1, 2, 3]
    for i, key in keys.items():
        assert found.for_worker(i) == {"ssh-ed25519": f"ssh-ed25519 {key}"}
    assert tpu_emulator.client.calls["GetGuestAttributes"] == 1


def test_host_keys_of_chosen_workers_are_indexed_by_worker(tpu_emulator):
    keys = {i: new_host_key() for i in range(4)}
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "pod", workers=4, host_keys={i: {"ssh-ed25519": k} for i, k in keys.items()}
    )

    found = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "pod", workers=[2])

    assert found.workers == {2: {"ssh-ed25519": f"ssh-ed25519 {keys[2]}"}}


def test_host_keys_published_as_whole_lines_are_accepted_and_junk_is_not(tpu_emulator):
    ed25519 = new_host_key()
    tpu_emulator.controls.add_node(
        PROJECT,
        ZONE,
        "vm",
        workers=1,
        host_keys={
            0: {
                "ssh-ed25519": f"ssh-ed25519 {ed25519} root@t1v-n-0",
                "ssh-rsa": ed25519,  # an ed25519 blob under the wrong name
                "ssh-dss": "AAAAB3NzaC1kc3M=",  # a type the portal does not pin
            }
        },
    )

    found = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "vm")

    assert found.for_worker(0) == {"ssh-ed25519": f"ssh-ed25519 {ed25519}"}


def test_a_worker_without_published_keys_has_none(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "fresh", workers=2, generate_host_keys=False)

    found = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "fresh")

    assert found.workers == {0: {}, 1: {}}


def test_the_configured_client_talks_to_the_emulator_from_settings(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")

    client = cloud_tpu()

    assert client is cloud_tpu()  # one shared channel per configuration
    assert client is not tpu_emulator.client
    assert [n.name for n in client.list_nodes(PROJECT, ZONE)] == ["tpu1"]

"""Importing, syncing and disks, against the emulator over a real gRPC channel."""

from __future__ import annotations

import pytest

from tpus.models import AuditEvent
from tpus.models.inventory import DataDisk, DiskAttachment, TpuVm
from tpus.services import inventory, sync

PROJECT = "vision-lab-1"
ZONE = "us-central1-f"


@pytest.fixture
def lab(make_lab):
    return make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])


@pytest.fixture
def admin(make_user):
    return make_user("boss@vision.example")


def _pod(emulator, name="tpu5", workers=4, **kwargs):
    emulator.controls.add_node(
        PROJECT,
        ZONE,
        name,
        accelerator_type=f"v4-{workers * 8}",
        workers=workers,
        external_ips=[f"34.0.0.{i + 1}" for i in range(workers)],
        **kwargs,
    )


def test_importing_a_pod_registers_every_worker_with_pinned_host_keys(tpu_emulator, lab, admin):
    _pod(tpu_emulator)
    preview = inventory.preview_import(lab)
    assert [c.key for c in preview.candidates] == [f"{ZONE}/tpu5"]
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    assert (vm.accelerator_type, vm.state, vm.health) == ("v4-32", "READY", "HEALTHY")
    workers = list(vm.workers.order_by("index"))
    assert [w.external_ip for w in workers] == ["34.0.0.1", "34.0.0.2", "34.0.0.3", "34.0.0.4"]
    assert all(w.host_keys and w.host_keys[0].startswith("ssh-ed25519 ") for w in workers)
    assert all(w.host_keys_source == "guest_attributes" for w in workers)
    assert len({w.host_keys[0] for w in workers}) == 4
    assert AuditEvent.objects.filter(action="vm.imported", lab=lab).count() == 1


def test_a_worker_without_published_keys_stays_unpinned(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=1, generate_host_keys=False)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    assert vm.workers.get().host_keys == []


def test_reimporting_never_replaces_a_pinned_host_key(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=1)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    pinned = vm.workers.get().host_keys
    # Anything in the VM can write guest attributes; a later value is never trusted.
    tpu_emulator.controls.set_host_key(
        "tpu5", 0, "ssh-ed25519", pinned[0].split()[1][:-8] + "AAAAAAAA"
    )
    inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    assert vm.workers.get().host_keys == pinned


def test_import_registers_disks_and_attachments(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=1)
    tpu_emulator.controls.attach("tpu5", "imagenet", "READ_ONLY")
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    attachment = DiskAttachment.objects.get(vm=vm)
    assert (attachment.disk.name, attachment.mode, attachment.disk.mount_point) == (
        "imagenet",
        "READ_ONLY",
        "/ssd",
    )


def test_importing_a_node_from_another_zone_is_refused(tpu_emulator, lab, admin):
    with pytest.raises(inventory.InventoryError, match="lab's zones"):
        inventory.import_vms(admin, lab, ["europe-west4-a/tpu5"])
    with pytest.raises(inventory.InventoryError, match="does not list nope"):
        inventory.import_vms(admin, lab, [f"{ZONE}/nope"])
    assert not TpuVm.objects.exists()


def test_sync_follows_state_health_and_addresses(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=2)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    tpu_emulator.controls.maintenance("tpu5")
    sync.sync_inventory()
    vm.refresh_from_db()
    assert vm.health == "UNHEALTHY_MAINTENANCE"
    # No IP during maintenance is not a change of address.
    assert [w.external_ip for w in vm.workers.order_by("index")] == ["34.0.0.1", "34.0.0.2"]
    tpu_emulator.controls.end_maintenance("tpu5", ["35.1.1.1", "35.1.1.2"])
    sync.sync_inventory()
    vm.refresh_from_db()
    assert vm.health == "HEALTHY"
    assert [w.external_ip for w in vm.workers.order_by("index")] == ["35.1.1.1", "35.1.1.2"]
    assert AuditEvent.objects.filter(action="vm.state_changed").count() == 2


def test_a_vanished_vm_is_marked_not_deleted(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=1)
    inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    tpu_emulator.controls.delete("tpu5")
    report = sync.sync_inventory()
    vm = TpuVm.objects.get()
    assert vm.missing_since is not None
    assert report.missing == 1


def test_an_unavailable_api_changes_nothing(tpu_emulator, lab, admin):
    _pod(tpu_emulator, workers=1)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    tpu_emulator.controls.delete("tpu5")
    tpu_emulator.controls.fail(10, "UNAVAILABLE")
    report = sync.sync_inventory()
    vm.refresh_from_db()
    assert vm.missing_since is None
    assert list(report.errors) == [f"{PROJECT}/{ZONE}"]


def test_a_permission_error_is_shown_to_the_admin_and_not_retried(tpu_emulator, lab):
    tpu_emulator.controls.fail(1, "PERMISSION_DENIED")
    preview = inventory.preview_import(lab)
    assert (
        "PERMISSION_DENIED" in preview.errors[ZONE] or "permission" in preview.errors[ZONE].lower()
    )
    assert tpu_emulator.requests["ListNodes"] == 1


def test_one_sync_of_500_vms_in_5_zones_makes_5_list_calls(tpu_emulator, make_lab, admin):
    zones = ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "europe-west4-a"]
    big = make_lab("Big", slug="big", gcp_project_id="big-lab-1", zones=zones)
    with tpu_emulator.controls.batch():
        for i in range(500):
            tpu_emulator.controls.add_node("big-lab-1", zones[i % 5], f"tpu{i}", workers=1)
    for zone in zones:
        inventory.import_vms(
            admin, big, [f"{zone}/tpu{i}" for i in range(500) if zones[i % 5] == zone][:3]
        )
    from tpus.cloud.config import cloud_tpu

    cloud_tpu().reset_calls()
    sync.sync_inventory()
    assert cloud_tpu().calls["ListNodes"] == 5


def test_a_read_only_disk_attaches_to_two_vms(tpu_emulator, lab, admin):
    _pod(tpu_emulator, "tpu1", workers=1)
    _pod(tpu_emulator, "tpu2", workers=1)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "imagenet")
    vm1, vm2 = inventory.import_vms(admin, lab, [f"{ZONE}/tpu1", f"{ZONE}/tpu2"])
    disk = inventory.register_disk(
        admin, lab, name="imagenet", zone=ZONE, size_gb=200, mount_point="/ssd"
    )
    inventory.attach_disk(admin, disk, vm1, "READ_ONLY")
    inventory.attach_disk(admin, disk, vm2, "READ_ONLY")
    assert set(disk.attachments.values_list("vm__name", flat=True)) == {"tpu1", "tpu2"}
    assert [d.name for d in tpu_emulator.client.get_node(PROJECT, ZONE, "tpu2").data_disks] == [
        "imagenet"
    ]


def test_a_read_write_disk_refuses_a_second_vm(tpu_emulator, lab, admin):
    _pod(tpu_emulator, "tpu1", workers=1)
    _pod(tpu_emulator, "tpu2", workers=1)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    vm1, vm2 = inventory.import_vms(admin, lab, [f"{ZONE}/tpu1", f"{ZONE}/tpu2"])
    disk = inventory.register_disk(
        admin, lab, name="scratch", zone=ZONE, size_gb=None, mount_point="/scratch"
    )
    inventory.attach_disk(admin, disk, vm1, "READ_WRITE")
    with pytest.raises(inventory.InventoryError, match="one VM only"):
        inventory.attach_disk(admin, disk, vm2, "READ_WRITE")
    assert list(disk.attachments.values_list("vm__name", flat=True)) == ["tpu1"]


def test_a_pod_takes_disks_read_only_and_mounts_a_read_write_one_read_only(
    tpu_emulator, lab, admin
):
    from tpus.services.reconcile import desired_state

    _pod(tpu_emulator, "tpu5", workers=4)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    disk = inventory.register_disk(
        admin, lab, name="scratch", zone=ZONE, size_gb=None, mount_point="/scratch"
    )
    version = TpuVm.objects.get(pk=vm.pk).desired_version

    with pytest.raises(inventory.InventoryError, match="tpu5 has 4 workers.*attach it read-only"):
        inventory.attach_disk(admin, disk, vm, "READ_WRITE")

    assert not disk.attachments.exists()
    assert tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5").data_disks == ()
    assert TpuVm.objects.get(pk=vm.pk).desired_version == version
    # Attached read-write outside the portal: every worker still mounts it read-only.
    node = tpu_emulator.client.attach_disk(PROJECT, ZONE, "tpu5", disk.source_disk(), "READ_WRITE")
    inventory.apply_disks(vm, node)
    assert disk.attachments.get().mode == "READ_WRITE"
    assert [m.read_only for m in desired_state(vm).mounts] == [True]


def test_detaching_twice_is_fine(tpu_emulator, lab, admin):
    _pod(tpu_emulator, "tpu1", workers=1)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "data")
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu1"])
    disk = inventory.register_disk(
        admin, lab, name="data", zone=ZONE, size_gb=1, mount_point="/ssd"
    )
    inventory.attach_disk(admin, disk, vm, "READ_ONLY")
    inventory.detach_disk(admin, disk, vm)
    inventory.detach_disk(admin, disk, vm)
    assert not DiskAttachment.objects.exists()
    assert DataDisk.objects.count() == 1


@pytest.mark.parametrize(
    "name, zone, mount, message",
    [
        ("Bad_Name", ZONE, "/ssd", "disk name"),
        ("data", "mars-north1-z", "/ssd", "not one of the lab's zones"),
        ("data", ZONE, "relative/path", "absolute path"),
        ("data", ZONE, "/ssd; rm -rf /", "absolute path"),
        ("data", ZONE, "/a/../etc", "no . or .."),
        ("data", ZONE, "/etc", "system directory"),
        ("data", ZONE, "/home/milo", "system directory"),
        ("data", ZONE, "/", "absolute path"),
    ],
)
def test_a_bad_disk_is_refused_with_a_reason(lab, admin, name, zone, mount, message):
    with pytest.raises(inventory.InventoryError, match=message):
        inventory.register_disk(admin, lab, name=name, zone=zone, size_gb=1, mount_point=mount)
    assert not DataDisk.objects.exists()


def test_a_quiet_poll_costs_the_same_queries_however_many_vms(tpu_emulator, lab, admin):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def add(start, count):
        with tpu_emulator.controls.batch():
            for i in range(start, start + count):
                tpu_emulator.controls.add_node(PROJECT, ZONE, f"tpu{i}", workers=2)
        inventory.import_vms(admin, lab, [f"{ZONE}/tpu{i}" for i in range(start, start + count)])

    def queries():
        sync.sync_inventory()  # settle anything the import left
        with CaptureQueriesContext(connection) as context:
            sync.sync_inventory()
        return len(context)

    add(0, 10)
    small = queries()
    add(10, 40)
    assert queries() == small

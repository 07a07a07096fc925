"""The lab admin's TPU VM and disk pages, against the emulator."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tpus.models import DataDisk, DiskAttachment, Lab, TpuVm

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


@pytest.fixture
def admin_client(client, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    client.force_login(admin)
    client.lab = lab
    return client


@pytest.fixture
def site_client(client, make_lab, make_user):
    """A site admin: the only one who registers a TPU VM by hand."""
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    client.force_login(make_user("root@portal.example", is_superuser=True, is_staff=True))
    client.lab = lab
    return client


def test_an_admin_imports_a_pod_and_sees_its_workers_and_fingerprints(admin_client, tpu_emulator):
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "tpu5", accelerator_type="v4-32", workers=4,
        external_ips=["34.0.0.1", "34.0.0.2", "34.0.0.3", "34.0.0.4"],
    )  # fmt: skip
    page = admin_client.get(reverse("vm_import", args=["vision"])).content.decode()
    assert f'value="{ZONE}/tpu5"' in page
    response = admin_client.post(reverse("vm_import", args=["vision"]), {"nodes": [f"{ZONE}/tpu5"]})
    assert response.status_code == 302
    vm = TpuVm.objects.get(name="tpu5")
    body = admin_client.get(reverse("vm_detail", args=["vision", vm.pk])).content.decode()
    for i in range(4):
        assert f"tpu5-w{i}" in body
        assert f"34.0.0.{i + 1}" in body
    assert body.count("ssh-ed25519 SHA256:") == 4


def test_an_import_of_a_node_that_is_not_offered_is_refused(admin_client, tpu_emulator):
    response = admin_client.post(reverse("vm_import", args=["vision"]), {"nodes": ["x/../../etc"]})
    assert response.status_code == 200
    assert "not one of the available choices" in response.content.decode()
    assert not TpuVm.objects.exists()


def test_an_api_outage_is_shown_per_zone_on_the_import_page(admin_client, tpu_emulator):
    tpu_emulator.controls.fail(5, "UNAVAILABLE")
    body = admin_client.get(reverse("vm_import", args=["vision"])).content.decode()
    assert f"{ZONE}: Cloud TPU API ListNodes failed: UNAVAILABLE" in body
    assert "lists no TPU VMs" not in body


def test_a_permission_refusal_is_explained_once_on_the_import_page(admin_client, tpu_emulator):
    tpu_emulator.controls.fail(5, "PERMISSION_DENIED")
    body = admin_client.get(reverse("vm_import", args=["vision"])).content.decode()
    assert body.count("may not list TPU VMs") == 1
    assert "roles/tpu.viewer" in body and "PERMISSION_DENIED" not in body.split("said:")[0]


def test_registering_by_hand_takes_worker_ips_one_per_line(site_client):
    response = site_client.post(
        reverse("vm_register", args=["vision"]),
        {
            "name": "tpu9",
            "zone": ZONE,
            "accelerator_type": "v3-8",
            "workers": "34.1.2.3 10.0.0.2\n",
        },
    )
    assert response.status_code == 302
    worker = TpuVm.objects.get(name="tpu9").workers.get()
    assert (worker.external_ip, worker.internal_ip, worker.host_keys) == (
        "34.1.2.3",
        "10.0.0.2",
        [],
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("name", "TPU 9; reboot", "A TPU VM name"),
        ("accelerator_type", "v3-8 && id", "accelerator type"),
        ("workers", "34.1.2.3\n$(reboot)", "is not an IP address"),
        ("workers", "", "This field is required"),
        ("zone", "mars-north1-a", "Select a valid choice"),
    ],
)
def test_a_bad_manual_registration_names_the_problem(site_client, field, value, message):
    data = {"name": "tpu9", "zone": ZONE, "accelerator_type": "v3-8", "workers": "34.1.2.3"}
    data[field] = value
    response = site_client.post(reverse("vm_register", args=["vision"]), data)
    assert message in response.content.decode()
    assert not TpuVm.objects.exists()


def test_a_read_only_disk_is_attached_to_two_vms_from_its_page(
    admin_client, tpu_emulator, django_capture_on_commit_callbacks
):
    for name in ("tpu1", "tpu2"):
        tpu_emulator.controls.add_node(PROJECT, ZONE, name, workers=1)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "imagenet")
    admin_client.post(
        reverse("vm_import", args=["vision"]), {"nodes": [f"{ZONE}/tpu1", f"{ZONE}/tpu2"]}
    )
    admin_client.post(
        reverse("disk_register", args=["vision"]),
        {"name": "imagenet", "zone": ZONE, "size_gb": 500, "mount_point": "/ssd"},
    )
    disk = DataDisk.objects.get(name="imagenet")
    for vm in TpuVm.objects.all():
        # The request only queues the operation; the task runs it after commit.
        with django_capture_on_commit_callbacks(execute=True):
            response = admin_client.post(
                reverse("disk_detail", args=["vision", disk.pk]),
                {"vm": vm.pk, "mode": "READ_ONLY"},
            )
        assert response.status_code == 302
    assert DiskAttachment.objects.filter(disk=disk).count() == 2
    vm_list = admin_client.get(reverse("vm_list", args=["vision"])).content.decode()
    assert "tpu1 (read-only), tpu2 (read-only)" in vm_list


def test_the_vm_list_query_count_does_not_grow_with_the_lab(
    admin_client, django_assert_max_num_queries
):
    lab = admin_client.lab
    for i in range(30):
        vm = TpuVm.objects.create(lab=lab, name=f"tpu{i}", zone=ZONE, source="manual")
        disk = DataDisk.objects.create(lab=lab, name=f"disk{i}", zone=ZONE)
        DiskAttachment.objects.create(disk=disk, vm=vm)
    with django_assert_max_num_queries(12):
        admin_client.get(reverse("vm_list", args=["vision"]))


def test_a_member_sees_only_the_vms_they_were_given(client, make_lab, make_user, add_member):
    from tpus.models import Grant

    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    mine = TpuVm.objects.create(lab=lab, name="tpu5", zone=ZONE, source="manual")
    other = TpuVm.objects.create(lab=lab, name="tpu6", zone=ZONE, source="manual")
    Grant.objects.create(user=milo, vm=mine, state="active")
    client.force_login(milo)
    assert client.get(reverse("vm_detail", args=["vision", mine.pk])).status_code == 200
    assert client.get(reverse("vm_detail", args=["vision", other.pk])).status_code == 404
    Grant.objects.filter(vm=mine).update(state="revoked")
    assert client.get(reverse("vm_detail", args=["vision", mine.pk])).status_code == 404


def test_a_refused_attach_is_shown_on_the_disk_page(
    admin_client, tpu_emulator, django_capture_on_commit_callbacks
):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1", workers=1)
    admin_client.post(reverse("vm_import", args=["vision"]), {"nodes": [f"{ZONE}/tpu1"]})
    admin_client.post(
        reverse("disk_register", args=["vision"]),
        {"name": "ghost", "zone": ZONE, "size_gb": 1, "mount_point": "/ssd"},
    )
    disk = DataDisk.objects.get(name="ghost")  # the project has no such disk
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(
            reverse("disk_detail", args=["vision", disk.pk]),
            {"vm": TpuVm.objects.get().pk, "mode": "READ_ONLY"},
        )
    operation = disk.operations.get()
    assert operation.state == "failed"
    assert "NOT_FOUND" in operation.error or "not found" in operation.error.lower()
    page = admin_client.get(reverse("disk_detail", args=["vision", disk.pk])).content.decode()
    assert "Failed" in page
    assert not DiskAttachment.objects.exists()


def test_a_queued_attach_keeps_the_page_polling_until_it_ends(admin_client, tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1", workers=1)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "imagenet")
    admin_client.post(reverse("vm_import", args=["vision"]), {"nodes": [f"{ZONE}/tpu1"]})
    admin_client.post(
        reverse("disk_register", args=["vision"]),
        {"name": "imagenet", "zone": ZONE, "size_gb": 1, "mount_point": "/ssd"},
    )
    disk = DataDisk.objects.get(name="imagenet")
    admin_client.post(
        reverse("disk_detail", args=["vision", disk.pk]),
        {"vm": TpuVm.objects.get().pk, "mode": "READ_ONLY"},
    )
    body = admin_client.get(reverse("disk_progress", args=["vision", disk.pk])).content.decode()
    assert 'hx-trigger="every 1s"' in body
    assert "Waiting" in body


def test_import_without_google_credentials_says_so_once_and_how_to_fix_it(client, cast, settings):
    settings.TPU_API_INSECURE = False
    settings.TPU_API_ENDPOINT = ""
    settings.TPU_API_CREDENTIALS_FILE = "/nonexistent/tpu-portal-sa.json"
    cast.lab.zones = ["us-central1-f", "europe-west4-a"]
    cast.lab.save()
    client.force_login(cast.admin)
    body = client.get(reverse("vm_import", args=[cast.lab.slug])).content.decode()
    assert body.count("no usable Google credentials") == 1
    assert "TPU_API_CREDENTIALS_FILE" in body and "bin/demo" in body
    assert "lists no TPU VMs" not in body
    assert "europe-west4-a:" not in body


def test_a_hand_registered_vm_page_offers_access_only_once_its_keys_are_confirmed(
    site_client,
):
    from tpus.models import Worker

    vm = TpuVm.objects.create(
        lab=Lab.objects.get(slug="vision"), name="tpu9", zone=ZONE, source="manual"
    )
    worker = Worker.objects.create(vm=vm, index=0, external_ip="198.18.0.9")
    body = site_client.get(reverse("vm_detail", args=["vision", vm.pk])).content.decode()
    assert "Registered by hand" in body
    assert "Unknown" not in body and "runtime <code>?" not in body
    assert "No one can be given access until its host keys are confirmed" in body
    access_url = reverse("vm_access", args=["vision", vm.pk])
    body = site_client.get(access_url).content.decode()
    assert "No one can be given access until the host keys" in body
    assert "Add to tpu9" not in body
    Worker.objects.filter(pk=worker.pk).update(
        host_keys=[
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIN8crqCQZGXDCh9KBbBRI4EGkWOX2SOeVCa1joX0XTan"
        ]
    )
    body = site_client.get(access_url).content.decode()
    assert "Add to tpu9" in body

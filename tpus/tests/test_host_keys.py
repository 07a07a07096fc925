"""Host keys an admin confirms: a VM registered by hand, and a worker whose key
changed. Scans and logins go to the real sshd fleet."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tpus.models import AuditEvent, TpuVm
from tpus.remote import RemoteError, scan_host_keys
from tpus.services import inventory

pytestmark = pytest.mark.fleet
ZONE = "us-central1-f"


@pytest.fixture
def admin_client(client, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    client.force_login(admin)
    client.lab, client.admin = lab, admin
    return client


def test_a_scan_reads_exactly_the_hosts_keys(fleet, fleet_host, fleet_settings):
    scanned = scan_host_keys(fleet_host.ip)
    assert set(scanned) == set(fleet.host_keys(fleet_host.name))


def test_a_scan_never_leaves_the_allowed_networks(fleet_settings):
    with pytest.raises(RemoteError, match="outside PORTAL_REMOTE_ALLOWED_NETWORKS"):
        scan_host_keys("192.0.2.1")


def test_an_admin_pins_the_keys_of_a_vm_registered_by_hand(
    admin_client, fleet, fleet_host, fleet_settings
):
    admin_client.post(
        reverse("vm_register", args=["vision"]),
        {"name": "tpu9", "zone": ZONE, "accelerator_type": "v3-8", "workers": fleet_host.ip},
    )
    vm = TpuVm.objects.get(name="tpu9")
    page = admin_client.get(reverse("worker_keys", args=["vision", vm.pk, 0]))
    body = page.content.decode()
    assert body.count("SHA256:") == len(fleet.host_keys(fleet_host.name))
    shown = re.search(r'name="shown" value="([^"]+)"', body).group(1)
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": shown})
    assert sorted(vm.workers.get().host_keys) == sorted(fleet.host_keys(fleet_host.name))


def test_keys_that_were_not_shown_cannot_be_pinned(admin_client, fleet_host, fleet_settings):
    vm = inventory.register_manual_vm(
        admin_client.admin, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    forged = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBa0y4ZpkYVX4nC8KMzJ4Fbr0uZ3cQJmW4e+v6k3kO2M"
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": forged})
    assert vm.workers.get().host_keys == []


def test_replacing_a_changed_key_is_deliberate_and_audited(
    admin_client, fleet, fleet_host, fleet_settings
):
    old = fleet.host_keys(fleet_host.name)
    vm = inventory.register_manual_vm(
        admin_client.admin, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    worker = vm.workers.get()
    inventory.pin_host_keys(admin_client.admin, worker, old)
    new = fleet.rekey(fleet_host.name)
    body = admin_client.get(reverse("worker_keys", args=["vision", vm.pk, 0])).content.decode()
    assert "Replace the pinned keys" in body
    shown = re.search(r'name="shown" value="([^"]+)"', body).group(1)
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": shown})
    worker.refresh_from_db()
    assert sorted(worker.host_keys) == sorted(new)
    event = AuditEvent.objects.filter(action="vm.host_keys_pinned").latest("id")
    assert sorted(event.data["previous"]) == sorted(old)

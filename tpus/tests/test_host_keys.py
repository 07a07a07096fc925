"""Host keys an admin confirms: a VM registered by hand, and a worker whose key
changed. Scans and logins go to the real sshd fleet."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tpus.models import AuditEvent, HostKeyScan, TpuVm
from tpus.models.inventory import ScanState
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
    # Registering by hand is a site admin's job; pinning is the lab admin's.
    client.root = make_user("root@portal.example", is_superuser=True, is_staff=True)
    return client


def scanned_page(client, vm, capture) -> str:
    """Start a scan from the keys page as the admin does (the task runs after
    commit), then the page as it reads once the scan is done."""
    url = reverse("worker_keys", args=[vm.lab.slug, vm.pk, 0])
    with capture(execute=True):
        assert client.post(url, {"action": "scan"}).status_code == 302
    return client.get(url).content.decode()


def test_a_scan_reads_exactly_the_hosts_keys(fleet, fleet_host, fleet_settings):
    scanned = scan_host_keys(fleet_host.ip)
    assert set(scanned) == set(fleet.host_keys(fleet_host.name))


def test_a_scan_never_leaves_the_allowed_networks(fleet_settings):
    with pytest.raises(RemoteError, match="outside PORTAL_REMOTE_ALLOWED_NETWORKS"):
        scan_host_keys("192.0.2.1")


def test_an_admin_pins_the_keys_of_a_vm_registered_by_hand(
    admin_client, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    admin_client.force_login(admin_client.root)
    admin_client.post(
        reverse("vm_register", args=["vision"]),
        {"name": "tpu9", "zone": ZONE, "accelerator_type": "v3-8", "workers": fleet_host.ip},
    )
    vm = TpuVm.objects.get(name="tpu9")
    body = scanned_page(admin_client, vm, django_capture_on_commit_callbacks)
    assert body.count("SHA256:") == len(fleet.host_keys(fleet_host.name))
    shown = re.search(r'name="shown" value="([^"]+)"', body).group(1)
    admin_client.force_login(admin_client.admin)
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": shown})
    assert sorted(vm.workers.get().host_keys) == sorted(fleet.host_keys(fleet_host.name))


def test_keys_that_were_not_shown_cannot_be_pinned(admin_client, fleet_host, fleet_settings):
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    forged = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBa0y4ZpkYVX4nC8KMzJ4Fbr0uZ3cQJmW4e+v6k3kO2M"
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": forged})
    assert vm.workers.get().host_keys == []


def test_replacing_a_changed_key_is_deliberate_and_audited(
    admin_client, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    old = fleet.host_keys(fleet_host.name)
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    worker = vm.workers.get()
    inventory.pin_host_keys(admin_client.admin, worker, old)
    new = fleet.rekey(fleet_host.name)
    body = scanned_page(admin_client, vm, django_capture_on_commit_callbacks)
    assert "Replace the pinned keys" in body
    shown = re.search(r'name="shown" value="([^"]+)"', body).group(1)
    admin_client.post(reverse("worker_keys", args=["vision", vm.pk, 0]), {"shown": shown})
    worker.refresh_from_db()
    assert sorted(worker.host_keys) == sorted(new)
    event = AuditEvent.objects.filter(action="vm.host_keys_pinned").latest("id")
    assert sorted(event.data["previous"]) == sorted(old)


def test_a_worker_that_now_reaches_another_labs_host_cannot_have_its_key_pinned(
    admin_client, make_lab, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    """Lab A's worker record points at lab B's real host (an address reused, or a
    record changed by any route): the scan shows lab B's key, and pinning it is
    refused."""
    other = make_lab("Other", slug="other", zones=[ZONE])
    theirs = TpuVm.objects.create(lab=other, name="tpu5", zone=ZONE, source="imported")
    theirs.workers.create(index=0, external_ip=fleet_host.ip)
    inventory.pin_host_keys(
        admin_client.root, theirs.workers.get(), fleet.host_keys(fleet_host.name)
    )
    mine = TpuVm.objects.create(lab=admin_client.lab, name="tpu9", zone=ZONE, source="manual")
    mine.workers.create(index=0, external_ip=fleet_host.ip)
    body = scanned_page(admin_client, mine, django_capture_on_commit_callbacks)
    shown = re.search(r'name="shown" value="([^"]+)"', body).group(1)
    response = admin_client.post(
        reverse("worker_keys", args=["vision", mine.pk, 0]), {"shown": shown}, follow=True
    )
    assert "already pinned for a worker of another lab" in response.content.decode()
    assert mine.workers.get().host_keys == []


def test_opening_the_keys_page_connects_to_nothing(admin_client, fleet_host, fleet_settings):
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    body = admin_client.get(reverse("worker_keys", args=["vision", vm.pk, 0])).content.decode()
    assert "SHA256:" not in body and "Scan the host keys" in body
    assert not HostKeyScan.objects.exists()


def test_a_scan_in_progress_shows_scanning_and_polls_until_it_is_done(
    admin_client, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    page = reverse("worker_keys", args=["vision", vm.pk, 0])
    poll = reverse("worker_keys_scan", args=["vision", vm.pk, 0])
    with django_capture_on_commit_callbacks() as queued:
        admin_client.post(page, {"action": "scan"})
    scan = HostKeyScan.objects.get()
    assert scan.state == ScanState.QUEUED and scan.address == fleet_host.ip
    assert len(queued) == 1  # the scan task, after commit

    waiting = admin_client.get(page).content.decode()
    assert "scanning…" in waiting and f'hx-get="{poll}"' in waiting
    assert 'name="shown"' not in waiting

    queued[0]()  # the worker runs the task
    done = admin_client.get(poll).content.decode()
    assert "scanning…" not in done and "hx-get" not in done
    assert done.count("SHA256:") == len(fleet.host_keys(fleet_host.name))
    assert 'name="shown"' in done


def test_a_scan_of_an_unreachable_worker_shows_why(
    admin_client, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    fleet.down(fleet_host.name, hang=False)
    body = scanned_page(admin_client, vm, django_capture_on_commit_callbacks)
    assert HostKeyScan.objects.get().state == ScanState.FAILED
    assert f"cannot connect to {fleet_host.ip}" in body and 'name="shown"' not in body


def test_keys_scanned_at_an_address_the_worker_has_left_are_not_offered(
    admin_client, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    assert "SHA256:" in scanned_page(admin_client, vm, django_capture_on_commit_callbacks)
    vm.workers.update(external_ip="10.213.99.99")
    body = admin_client.get(reverse("worker_keys", args=["vision", vm.pk, 0])).content.decode()
    assert "SHA256:" not in body and 'name="shown"' not in body


def test_a_scan_another_run_holds_is_not_scanned_twice(admin_client, fleet_host, fleet_settings):
    from tpus.services import hostkey_scans

    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    scan = HostKeyScan.objects.create(
        worker=vm.workers.get(), state=ScanState.SCANNING, address=fleet_host.ip
    )
    hostkey_scans.run_scan(scan.pk)  # the same task delivered a second time
    scan.refresh_from_db()
    assert scan.state == ScanState.SCANNING and scan.keys == [] and scan.finished_at is None


def test_the_sweep_runs_again_a_scan_whose_task_was_lost_or_whose_run_died(
    admin_client, fleet, fleet_host, fleet_settings, django_capture_on_commit_callbacks
):
    import datetime as dt

    from django.utils import timezone

    from tpus.services import maintenance

    vm = inventory.register_manual_vm(
        admin_client.root, admin_client.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=fleet_host.ip)],
    )  # fmt: skip
    worker = vm.workers.get()
    long_ago = timezone.now() - dt.timedelta(hours=1)
    fresh = HostKeyScan.objects.create(worker=worker, address=fleet_host.ip)
    with django_capture_on_commit_callbacks(execute=True):
        maintenance.requeue_stuck_work()
    fresh.refresh_from_db()
    assert fresh.state == ScanState.QUEUED  # its task may still come: left alone

    for stuck_state in (ScanState.QUEUED, ScanState.SCANNING):
        HostKeyScan.objects.filter(pk=fresh.pk).update(
            state=stuck_state, requested_at=long_ago, keys=[], finished_at=None
        )
        with django_capture_on_commit_callbacks(execute=True):
            maintenance.requeue_stuck_work()
        scan = HostKeyScan.objects.get(pk=fresh.pk)
        assert scan.state == ScanState.DONE, stuck_state
        assert len(scan.keys) == len(fleet.host_keys(fleet_host.name))

    # What a dead run writes late (its old request) no longer lands.
    late = HostKeyScan.objects.filter(
        pk=fresh.pk, state=ScanState.SCANNING, requested_at=long_ago
    ).update(state=ScanState.FAILED, error="late")
    assert late == 0 and HostKeyScan.objects.get(pk=fresh.pk).state == ScanState.DONE

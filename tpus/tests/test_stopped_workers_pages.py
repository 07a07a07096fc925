"""While a worker's provisioning is stopped (a host key alarm from a key it presented,
or a reconcile it failed for good), the VM's page says so where it would otherwise
look fine: the state badge, the connection line, and the member's "Your access"."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from tpus.models import ConnectionState, Grant, TpuVm, VmConnection, Worker, WorkerSync

ED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGmq8Ajnn7qAVXoI9/9HUd9WQnXOJk4aOuq2SPeVvJGh"
OTHER = ED.replace("Gmq8", "Gmq9")


@pytest.fixture
def tpu5(cast):
    vm = TpuVm.objects.create(
        lab=cast.lab, name="tpu5", zone="us-central1-f", source="imported",
        state="READY", health="HEALTHY",
    )  # fmt: skip
    for index in range(2):
        worker = Worker.objects.create(
            vm=vm, index=index, external_ip=f"192.0.2.{index + 1}", host_keys=[ED]
        )
        WorkerSync.objects.create(worker=worker, applied_version=1, last_success_at=timezone.now())
    VmConnection.objects.create(vm=vm, state=ConnectionState.CONNECTED)
    Grant.objects.create(user=cast.member, vm=vm, state="active", version=1)
    return vm


def _pages(client, cast, vm) -> tuple[str, str, str]:
    """The admin's overview, the live connection part, and the member's overview."""
    client.force_login(cast.admin)
    admin = client.get(reverse("vm_detail", args=[cast.lab.slug, vm.pk])).content.decode()
    live = client.get(reverse("vm_connection", args=[cast.lab.slug, vm.pk])).content.decode()
    client.force_login(cast.member)
    member = client.get(reverse("vm_detail", args=[cast.lab.slug, vm.pk])).content.decode()
    return admin, live, member


def _presented_alarm(vm):
    Worker.objects.filter(vm=vm, index=1).update(
        host_key_mismatch_at=timezone.now(), presented_host_key=OTHER
    )


def _failed_for_good(vm):
    WorkerSync.objects.filter(worker__vm=vm, worker__index=1).update(
        last_error="sshd does not use the portal's key files", last_error_retryable=False
    )


def test_a_vm_whose_workers_are_all_provisioned_looks_fine(client, cast, tpu5):
    admin, live, member = _pages(client, cast, tpu5)
    assert '<span class="badge ok">Ready</span> Healthy' in admin
    assert "Provisioning stopped" not in admin and "is stopped on" not in live
    assert '<span class="badge active">Active</span>' in member
    assert "cannot set up" not in member


@pytest.mark.parametrize(
    "stop, what, why",
    [
        (_presented_alarm, "host key alarm", "presented a host key that is not the pinned one"),
        (_failed_for_good, "provisioning failed", "sshd does not use the portal&#x27;s key files"),
    ],
)
def test_a_stopped_worker_shows_on_the_badge_the_connection_line_and_your_access(
    client, cast, tpu5, stop, what, why
):
    stop(tpu5)
    admin, live, member = _pages(client, cast, tpu5)

    assert '<span class="badge failed">Ready</span>' in admin
    assert f'<span class="badge failed">Provisioning stopped</span> on tpu5-w1 ({what})' in admin
    assert "Connected" in live
    assert "The lab's key is accepted, but provisioning is stopped on tpu5-w1" in live
    assert why in live
    assert '<span class="badge failed">Active</span>' in member
    assert f"cannot set up tpu5-w1 ({what})" in member
    assert "tpu5-w0" not in member.split("cannot set up")[1].split("</p>")[0]


def test_an_alarm_about_published_keys_only_does_not_stop_the_worker(client, cast, tpu5):
    Worker.objects.filter(vm=tpu5, index=1).update(
        host_key_mismatch_at=timezone.now(), presented_host_key=OTHER, host_key_alarm_published=True
    )
    admin, live, member = _pages(client, cast, tpu5)
    assert "Provisioning stopped" not in admin and "is stopped on" not in live
    assert "still provisioned" in admin
    assert "cannot set up" not in member


def test_a_worker_that_is_only_unreachable_for_now_is_not_called_stopped(client, cast, tpu5):
    WorkerSync.objects.filter(worker__vm=tpu5, worker__index=1).update(
        last_error="connection timed out", last_error_retryable=True
    )
    admin, live, member = _pages(client, cast, tpu5)
    assert "Provisioning stopped" not in admin and "cannot set up" not in member


def test_the_vm_list_marks_a_vm_with_a_stopped_worker(client, cast, tpu5):
    client.force_login(cast.admin)
    url = reverse("vm_list", args=[cast.lab.slug])
    assert "provisioning stopped" not in client.get(url).content.decode()
    _presented_alarm(tpu5)
    _failed_for_good(tpu5)  # the same worker: counted once
    page = client.get(url).content.decode()
    assert '<span class="badge failed">Ready</span>' in page
    assert "provisioning stopped on 1 worker<" in page


def test_the_members_list_of_their_vms_says_when_a_worker_is_stopped(client, cast, tpu5):
    client.force_login(cast.member)
    url = reverse("lab_detail", args=[cast.lab.slug])
    assert "cannot set up" not in client.get(url).content.decode()
    _presented_alarm(tpu5)
    page = client.get(url).content.decode()
    assert '<span class="badge failed">Active</span>' in page
    assert "cannot set up 1 of its workers" in page

"""A host key change the Cloud TPU API publishes, on the real sshd fleet: the worker is
flagged at the next sync and the admins are emailed once, while grants and revokes
still reach it (the host presents its pinned key, which guards every connection)."""

from __future__ import annotations

import pytest
from django.core import mail

from tpus.cloud.config import cloud_tpu
from tpus.emulator.controls import new_host_key
from tpus.models import Worker
from tpus.services import sync
from tpus.services.grants import grant_access, revoke_access
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)

pytestmark = pytest.mark.fleet


def _has_account(pod, host) -> bool:  # noqa: F811
    username = pod.fresh(pod.milo).unix_account.username
    found = pod.fleet.exec(host.name, ["getent", "passwd", username], check=False)
    return found.returncode == 0


def _alerts() -> list:
    return [m for m in mail.outbox if "Host key" in m.subject]


def test_a_published_key_change_alarms_the_admins_and_the_worker_is_still_provisioned(
    pod,  # noqa: F811
    tpu_emulator,
    settings,
    django_capture_on_commit_callbacks,
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 1
    # The host behind worker 1 keeps its keys; only what the API publishes changes (as
    # any process on the VM may make it, through the guest attributes).
    new = new_host_key()
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new)
    cloud_tpu().reset_calls()
    with django_capture_on_commit_callbacks(execute=True):
        sync.sync_inventory()
    assert dict(cloud_tpu().calls) == {"ListNodes": 1, "GetGuestAttributes": 1}
    worker = Worker.objects.get(vm=pod.vm, index=1)
    assert worker.host_key_mismatch_at is not None and worker.host_key_alarm_published
    assert worker.presented_host_key == f"ssh-ed25519 {new}"
    [alert] = _alerts()
    assert alert.to == ["boss@vision.example"]

    # The pinned key still guards the connection: the grant reaches every worker ...
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert [_has_account(pod, h) for h in pod.hosts] == [True, True, True, True]
    assert pod.ssh("tpu5-w1").returncode == 0
    # ... and so does the revoke.
    with django_capture_on_commit_callbacks(execute=True):
        revoke_access(pod.admin, grant)
    grant.refresh_from_db()
    assert grant.state == "revoked"
    assert pod.ssh("tpu5-w1").returncode != 0

    # The alarm stays for the admins (presenting the pinned key says nothing about what
    # is published); more syncs with the same published set: still one email, same pin.
    with django_capture_on_commit_callbacks(execute=True):
        sync.sync_inventory()
        sync.sync_inventory()
    assert Worker.objects.get(pk=worker.pk).host_key_mismatch_at is not None
    assert len(_alerts()) == 1
    assert Worker.objects.get(pk=worker.pk).host_keys == worker.host_keys


def test_a_reboot_seen_by_a_reconcile_asks_the_next_sync_to_compare_the_keys(
    pod,  # noqa: F811
    tpu_emulator,
    settings,
    django_capture_on_commit_callbacks,
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    pod.fleet.reboot(pod.hosts[2].name)
    tpu_emulator.controls.set_host_key("tpu5", 2, "ssh-ed25519", new_host_key())
    from tpus.services.reconcile import reconcile_vm

    reconcile_vm(pod.vm.pk)
    assert Worker.objects.get(vm=pod.vm, index=2).published_keys_recheck
    cloud_tpu().reset_calls()
    with django_capture_on_commit_callbacks(execute=True):
        sync.sync_inventory()
    assert cloud_tpu().calls["GetGuestAttributes"] == 1
    worker = Worker.objects.get(vm=pod.vm, index=2)
    assert worker.host_key_mismatch_at is not None and not worker.published_keys_recheck
    assert len(_alerts()) == 1

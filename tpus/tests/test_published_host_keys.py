"""A host key change published by the Cloud TPU API is noticed: the sync compares the
published keys with the pins when there is a reason to, and a few more VMs each time,
and a change raises the alarm and emails the admins (repeats rate-limited), nothing
re-pinned; unlike a presented one, it does not stop the worker."""

from __future__ import annotations

import time

import pytest
from django.core import mail
from django.urls import reverse

from tpus.cloud.config import cloud_tpu
from tpus.emulator.controls import new_host_key
from tpus.models import AuditEvent, TpuVm, Worker
from tpus.models.inventory import published_key_changes
from tpus.services import inventory, sync
from tpus.templatetags.tpus_extras import host_key_fingerprint

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
ED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGmq8Ajnn7qAVXoI9/9HUd9WQnXOJk4aOuq2SPeVvJGh"
ED2 = ED.replace("Gmq8", "Gmq9")
ECDSA = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTY="


class TestWhatCountsAsAChange:
    def test_the_pinned_set_published_again_is_no_change(self):
        assert published_key_changes([ED], [ED]) == []

    def test_a_key_type_the_portal_does_not_pin_is_no_change(self):
        assert published_key_changes([ED], [ED, ECDSA]) == []

    def test_nothing_published_is_no_change(self):
        assert published_key_changes([ED], []) == []

    def test_a_pinned_type_published_missing_is_no_change(self):
        assert published_key_changes([ED, ECDSA], [ED]) == []

    def test_another_key_of_a_pinned_type_is_a_change(self):
        assert published_key_changes([ED, ECDSA], [ED2, ECDSA]) == [ED2]

    def test_a_set_sharing_no_type_with_the_pins_is_a_change(self):
        assert published_key_changes([ED], [ECDSA]) == [ECDSA]


@pytest.fixture
def lab(tpu_emulator, cast, settings):
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    return lab


def _import(tpu_emulator, cast, lab, name: str, workers: int = 2) -> TpuVm:
    tpu_emulator.controls.add_node(PROJECT, ZONE, name, accelerator_type="v4-16", workers=workers)
    [vm] = inventory.import_vms(cast.admin, lab, [f"{ZONE}/{name}"])
    return vm


@pytest.fixture
def tpu5(tpu_emulator, cast, lab):
    vm = _import(tpu_emulator, cast, lab, "tpu5")
    assert all(w.is_pinned for w in vm.workers.all())
    mail.outbox.clear()
    return vm


def _sync(capture):
    with capture(execute=True):
        return sync.sync_inventory()


def _alerts() -> list:
    return [m for m in mail.outbox if "Host key" in m.subject]


def test_a_published_key_change_raises_the_alarm_and_emails_the_admins_once(
    tpu5, tpu_emulator, django_capture_on_commit_callbacks
):
    pinned = list(tpu5.workers.get(index=1).host_keys)
    new = new_host_key()
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new)
    report = _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    assert [w.alias for w in report.host_key_changes] == ["tpu5-w1"]
    assert worker.host_key_mismatch_at is not None
    assert worker.presented_host_key == f"ssh-ed25519 {new}"
    assert worker.host_keys == pinned  # never re-pinned by itself
    assert Worker.objects.get(vm=tpu5, index=0).host_key_mismatch_at is None
    [alert] = _alerts()
    assert alert.to == ["admin@vision.example"] and "tpu5-w1" in alert.subject
    assert "please review" in alert.subject and "stopped" not in alert.subject
    assert "Cloud TPU API now publishes" in alert.body and new in alert.body
    assert "keeps provisioning it" in alert.body
    # The next syncs see the same published set: no second alarm, no second email.
    _sync(django_capture_on_commit_callbacks)
    _sync(django_capture_on_commit_callbacks)
    assert len(_alerts()) == 1
    assert AuditEvent.objects.filter(action="vm.host_key_changed").count() == 1


def test_an_unchanged_published_set_raises_nothing(
    tpu5, tpu_emulator, django_capture_on_commit_callbacks
):
    # A key type the portal did not pin appears: not a change either.
    tpu_emulator.controls.set_host_key("tpu5", 0, "ssh-rsa", "")
    for _ in range(3):
        report = _sync(django_capture_on_commit_callbacks)
        assert report.host_key_changes == []
    assert not Worker.objects.filter(host_key_mismatch_at__isnull=False).exists()
    assert not _alerts()
    assert all(w.published_keys_checked_at for w in tpu5.workers.all())


def test_the_slow_pass_is_bounded_and_takes_the_least_recently_compared_first(
    tpu_emulator, cast, lab, settings
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 2
    vms = [_import(tpu_emulator, cast, lab, f"tpu{i}", workers=1) for i in range(5)]
    before = {vm.pk: vm.workers.get().published_keys_checked_at for vm in vms}
    compared = []
    for _ in range(3):
        cloud_tpu().reset_calls()
        sync.sync_inventory([lab])
        assert dict(cloud_tpu().calls) == {"ListNodes": 1, "GetGuestAttributes": 2}
        now = {w.vm_id: w.published_keys_checked_at for w in Worker.objects.filter(vm__in=vms)}
        compared.append(sorted(pk for pk in now if now[pk] != before[pk]))
        before = now
    # Oldest first: the five VMs in turn, then the first again.
    assert compared == [
        sorted([vms[0].pk, vms[1].pk]),
        sorted([vms[2].pk, vms[3].pk]),
        sorted([vms[4].pk, vms[0].pk]),
    ]


def test_a_new_address_has_the_published_keys_compared_at_once(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    tpu_emulator.controls.set_host_key("tpu5", 0, "ssh-ed25519", new_host_key())
    _sync(django_capture_on_commit_callbacks)
    assert not _alerts()  # no reason to look, and no share of the slow pass
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    cloud_tpu().reset_calls()
    _sync(django_capture_on_commit_callbacks)
    assert cloud_tpu().calls["GetGuestAttributes"] == 1
    assert Worker.objects.get(vm=tpu5, index=0).host_key_mismatch_at is not None
    assert len(_alerts()) == 1


def test_a_re_created_vm_is_pinned_again_from_what_it_publishes_with_no_alarm(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    addresses = list(tpu5.workers.order_by("index").values_list("external_ip", flat=True))
    before = {w.index: w.host_keys for w in tpu5.workers.all()}
    tpu_emulator.controls.delete("tpu5")
    # Same name, same addresses, new hosts: only the create_time and the keys differ.
    time.sleep(1.1)
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "tpu5", accelerator_type="v4-16", workers=2, external_ips=addresses
    )
    _sync(django_capture_on_commit_callbacks)
    # The API says the node is newer than the pins: new machines, not impostors.
    assert not Worker.objects.filter(vm=tpu5, host_key_mismatch_at__isnull=False).exists()
    assert not _alerts()
    published = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "tpu5")
    for worker in tpu5.workers.all():
        assert worker.host_keys == sorted(published.for_worker(worker.index).values())
        assert worker.host_keys != before[worker.index]


def test_a_worker_of_a_vm_made_anew_that_publishes_its_keys_late_is_pinned_at_a_later_sync(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    addresses = list(tpu5.workers.order_by("index").values_list("external_ip", flat=True))
    tpu_emulator.controls.delete("tpu5")
    time.sleep(1.1)
    # New machines; worker 1's guest agent has not written its keys yet.
    tpu_emulator.controls.add_node(
        PROJECT,
        ZONE,
        "tpu5",
        accelerator_type="v4-16",
        workers=2,
        external_ips=addresses,
        host_keys={0: {"ssh-ed25519": new_host_key()}},
        generate_host_keys=False,
    )
    _sync(django_capture_on_commit_callbacks)
    late = Worker.objects.get(vm=tpu5, index=1)
    assert Worker.objects.get(vm=tpu5, index=0).is_pinned and not late.is_pinned
    version = TpuVm.objects.get(pk=tpu5.pk).desired_version

    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
    _sync(django_capture_on_commit_callbacks)

    late.refresh_from_db()
    published = tpu_emulator.client.guest_host_keys(PROJECT, ZONE, "tpu5")
    assert late.host_keys == sorted(published.for_worker(1).values())
    assert late.host_keys_source == "guest_attributes"
    # The VM is set up again, now on both workers; nobody was alarmed.
    assert TpuVm.objects.get(pk=tpu5.pk).desired_version > version
    assert not _alerts()
    assert AuditEvent.objects.filter(summary__contains="host keys of worker 1 taken").exists()


def test_a_vm_listed_again_after_missing_has_its_published_keys_compared(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    record = tpu_emulator.controls.show()["nodes"][
        f"projects/{PROJECT}/locations/{ZONE}/nodes/tpu5"
    ]
    tpu_emulator.controls.delete("tpu5")
    _sync(django_capture_on_commit_callbacks)
    assert TpuVm.objects.get(pk=tpu5.pk).is_missing
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "tpu5", accelerator_type="v4-16", workers=2,
        external_ips=[w["external_ip"] for w in record["workers"]],
    )  # fmt: skip
    _sync(django_capture_on_commit_callbacks)
    assert Worker.objects.filter(vm=tpu5, host_key_mismatch_at__isnull=False).count() == 2


def test_a_reboot_seen_by_a_reconcile_has_the_next_sync_compare_the_keys(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
    # What a reconcile records when a worker answers with another boot id.
    Worker.objects.filter(vm=tpu5, index=1).update(published_keys_recheck=True)
    _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    assert worker.host_key_mismatch_at is not None and not worker.published_keys_recheck


def test_an_admin_who_resumed_is_not_alarmed_again_by_the_same_published_key(
    tpu5, tpu_emulator, cast, django_capture_on_commit_callbacks
):
    from tpus.services.hostkey_alarms import resume_after_alarm

    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
    _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    with django_capture_on_commit_callbacks(execute=False):
        assert resume_after_alarm(cast.admin, worker)
    _sync(django_capture_on_commit_callbacks)
    assert Worker.objects.get(pk=worker.pk).host_key_mismatch_at is None
    # Another published key is news again.
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
    _sync(django_capture_on_commit_callbacks)
    assert Worker.objects.get(pk=worker.pk).host_key_mismatch_at is not None
    assert len(_alerts()) == 2


def test_the_keys_page_shows_the_pinned_and_the_published_fingerprints(
    tpu5, tpu_emulator, cast, client, django_capture_on_commit_callbacks
):
    new = f"ssh-ed25519 {new_host_key()}"
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new.split()[1])
    _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    client.force_login(cast.admin)
    html = client.get(reverse("worker_keys", args=[cast.lab.slug, tpu5.pk, 1])).content.decode()
    assert host_key_fingerprint(worker.host_keys[0]) in html
    assert host_key_fingerprint(new) in html
    assert "the Cloud TPU API published" in html and "differs from the pinned keys" in html


def test_published_keys_changing_again_are_told_again_at_most_once_per_window(
    tpu5, tpu_emulator, settings, django_capture_on_commit_callbacks
):
    import datetime as dt

    from django.utils import timezone

    settings.PORTAL_HOST_KEY_ALERT_REPEAT_SECONDS = 3600
    for _ in range(3):  # a process on the VM rewrites its guest attributes, again and again
        tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
        _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    assert worker.host_key_alarm_published
    assert len(_alerts()) == 1
    assert AuditEvent.objects.filter(action="vm.host_key_changed").count() == 3  # each kept
    # An hour on, the next change is mailed again.
    Worker.objects.filter(pk=worker.pk).update(
        host_key_alerted_at=timezone.now() - dt.timedelta(seconds=3601)
    )
    latest = new_host_key()
    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", latest)
    _sync(django_capture_on_commit_callbacks)
    assert len(_alerts()) == 2 and latest in _alerts()[-1].body


def test_a_presented_key_on_a_worker_with_a_published_alarm_stops_it_and_is_told_at_once(
    tpu5, tpu_emulator, django_capture_on_commit_callbacks
):
    from tpus.services.hostkey_alarms import raise_alarm
    from tpus.services.reconcile import _host_key_matches_again

    tpu_emulator.controls.set_host_key("tpu5", 1, "ssh-ed25519", new_host_key())
    _sync(django_capture_on_commit_callbacks)
    worker = Worker.objects.get(vm=tpu5, index=1)
    # Presenting the pinned key says nothing about what the API publishes.
    _host_key_matches_again(worker)
    assert Worker.objects.get(pk=worker.pk).host_key_mismatch_at is not None
    impostor = f"ssh-ed25519 {new_host_key()}"

    with django_capture_on_commit_callbacks(execute=True):
        assert raise_alarm(worker, impostor)

    worker.refresh_from_db()
    assert not worker.host_key_alarm_published and worker.presented_host_key == impostor
    assert len(_alerts()) == 2 and "provisioning stopped" in _alerts()[-1].subject
    with django_capture_on_commit_callbacks(execute=True):
        assert not raise_alarm(worker, impostor)  # once per alarm
    assert len(_alerts()) == 2

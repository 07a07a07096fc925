"""IP changes: detected by the periodic sync, one email per affected person per
change, and an ssh config that follows (checked with the real `ssh -G`)."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
from django.core import mail
from django.db import connection
from django.db.models import F

from accounts.unix import choose_username
from tests.requirements import need
from tpus.models import Grant, IpChange, IpChangeNotice, TpuVm
from tpus.services import inventory, sshconfig, sync

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


def _next_version(vm) -> int:
    """A desired version that carries a grant made by hand (no reconcile queued)."""
    TpuVm.objects.filter(pk=vm.pk).update(desired_version=F("desired_version") + 1)
    return TpuVm.objects.get(pk=vm.pk).desired_version


@pytest.fixture
def scene(tpu_emulator, make_lab, make_user, add_member):
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    tpu_emulator.controls.add_node(
        PROJECT, ZONE, "tpu5", accelerator_type="v4-16", workers=2,
        external_ips=["34.0.0.1", "34.0.0.2"],
    )  # fmt: skip
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    people = []
    for name in ("milo", "ada"):
        user = make_user(f"{name}@uni.example")
        add_member(lab, user)
        choose_username(user, name)
        Grant.objects.create(user=user, vm=vm, state="active", version=_next_version(vm))
        people.append(type(user).objects.get(pk=user.pk))
    mail.outbox.clear()
    return tpu_emulator, vm, people


def _poll(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        return sync.sync_inventory()


def test_a_new_ip_is_one_change_and_one_email_per_person(scene, django_capture_on_commit_callbacks):
    emulator, vm, people = scene
    emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    report = _poll(django_capture_on_commit_callbacks)
    assert report.ip_changes == 1
    change = IpChange.objects.get()
    assert (change.old_ip, change.new_ip, change.worker.index) == ("34.0.0.1", "35.9.9.9", 0)
    assert sorted(m.to[0] for m in mail.outbox) == ["ada@uni.example", "milo@uni.example"]
    assert all("35.9.9.9" in m.subject and "HostName 35.9.9.9" in m.body for m in mail.outbox)
    _poll(django_capture_on_commit_callbacks)
    assert IpChange.objects.count() == 1
    assert len(mail.outbox) == 2


def test_an_unavailable_api_during_a_poll_is_no_change(scene, django_capture_on_commit_callbacks):
    emulator, vm, _ = scene
    emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    emulator.controls.fail(10, "UNAVAILABLE")
    report = _poll(django_capture_on_commit_callbacks)
    assert report.errors
    assert not IpChange.objects.exists()
    assert not mail.outbox


def test_maintenance_without_an_ip_then_a_new_ip_is_one_change(
    scene, django_capture_on_commit_callbacks
):
    emulator, vm, _ = scene
    emulator.controls.maintenance("tpu5")
    _poll(django_capture_on_commit_callbacks)
    assert not IpChange.objects.exists()
    emulator.controls.end_maintenance("tpu5", ["36.1.1.1", "36.1.1.2"])
    _poll(django_capture_on_commit_callbacks)
    assert sorted(IpChange.objects.values_list("worker__index", "new_ip")) == [
        (0, "36.1.1.1"),
        (1, "36.1.1.2"),
    ]
    # Each worker's change is its own: two changes, two emails each.
    assert IpChangeNotice.objects.count() == 4
    assert len(mail.outbox) == 4


def test_each_pod_worker_is_tracked_separately(scene, django_capture_on_commit_callbacks):
    emulator, vm, _ = scene
    emulator.controls.set_ip("tpu5", 1, "37.0.0.2")
    _poll(django_capture_on_commit_callbacks)
    assert list(IpChange.objects.values_list("worker__index", flat=True)) == [1]
    assert list(vm.workers.order_by("index").values_list("external_ip", flat=True)) == [
        "34.0.0.1",
        "37.0.0.2",
    ]


@pytest.mark.django_db(transaction=True)
def test_two_polls_at_once_send_one_email(tpu_emulator, make_lab, make_user, add_member):
    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu5", workers=1, external_ips=["34.0.0.1"])
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    Grant.objects.create(user=milo, vm=vm, state="active")
    tpu_emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    barrier = threading.Barrier(2)

    def poll():
        barrier.wait()
        try:
            sync.sync_inventory()
        finally:
            connection.close()

    threads = [threading.Thread(target=poll) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert IpChange.objects.count() == 1
    assert IpChangeNotice.objects.count() == 1
    assert len([m for m in mail.outbox if "35.9.9.9" in m.subject]) == 1


def test_one_poll_makes_one_list_call_per_zone(scene, settings):
    emulator, _, _ = scene
    from tpus.cloud.config import cloud_tpu

    # Without the slow pass over published host keys (tested in test_published_host_keys).
    settings.PORTAL_HOST_KEY_CHECKS_PER_SYNC = 0
    cloud_tpu().reset_calls()
    sync.sync_inventory()
    assert dict(cloud_tpu().calls) == {"ListNodes": 1}


def test_the_config_resolves_with_the_real_ssh_client(scene, tmp_path):
    need(shutil.which("ssh") is not None, "needs OpenSSH's ssh client (apt install openssh-client)")
    _, vm, (milo, _) = scene
    config = tmp_path / "config"
    config.write_text(sshconfig.render_config(milo))
    known = tmp_path / "known_hosts"
    known.write_text(sshconfig.render_known_hosts(sshconfig.vms_for(milo)))

    def resolved(host):
        out = subprocess.run(
            ["ssh", "-G", "-F", str(config), host], capture_output=True, text=True, check=True
        ).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    main, second = resolved("tpu5"), resolved("tpu5-w1")
    assert (main["hostname"], main["user"]) == ("34.0.0.1", "milo")
    assert main["hostkeyalias"] == "tpu-portal.vision.tpu5.w0"
    assert main["stricthostkeychecking"] in {"true", "yes"}
    assert second["hostname"] == "34.0.0.2"
    assert second["hostkeyalias"] == "tpu-portal.vision.tpu5.w1"
    lines = known.read_text().splitlines()
    assert [line.split()[0] for line in lines] == [
        "tpu-portal.vision.tpu5.w0",
        "tpu-portal.vision.tpu5.w1",
    ]
    # The pinned keys are exactly the workers' keys.
    assert [" ".join(line.split()[1:]) for line in lines] == [
        w.host_keys[0] for w in vm.workers.order_by("index")
    ]


def test_the_refresh_url_works_until_it_is_rotated(client, scene):
    _, _, (milo, _) = scene
    client.force_login(milo)
    client.post("/ssh/feed/rotate/")
    urls = sshconfig.feed_urls(milo)
    client.logout()
    path = urls["config"].removeprefix("http://127.0.0.1:8000")
    response = client.get(path)
    assert response.status_code == 200
    assert "Host tpu5" in response.content.decode()
    sshconfig.rotate_feed(milo)
    assert client.get(path).status_code == 404
    new = sshconfig.feed_urls(milo)["known_hosts"].removeprefix("http://127.0.0.1:8000")
    assert client.get(new).content.decode().startswith("tpu-portal.vision.tpu5.w0 ssh-ed25519 ")
    sshconfig.disable_feed(milo)
    assert client.get(new).status_code == 404


def test_the_first_refresh_url_is_not_announced_as_a_replacement(client, scene):
    _, _, (milo, _) = scene
    client.force_login(milo)
    first = client.post("/ssh/feed/rotate/", follow=True).content.decode()
    assert "Your refresh URL is ready" in first
    assert "old one" not in first
    again = client.post("/ssh/feed/rotate/", follow=True).content.decode()
    assert "the old one no longer works" in again


def test_the_ip_change_email_points_to_the_ssh_page_not_the_refresh_url(
    scene, django_capture_on_commit_callbacks
):
    emulator, _, (milo, ada) = scene
    sshconfig.rotate_feed(milo)
    emulator.controls.set_ip("tpu5", 0, "35.9.9.9")
    _poll(django_capture_on_commit_callbacks)
    [message] = [m for m in mail.outbox if m.to == ["milo@uni.example"]]
    token = sshconfig.feed_urls(milo)["config"].split("/")[-2]
    assert token not in message.body
    assert token not in message.subject
    assert "/ssh/feed/" not in message.body
    assert "run your refresh command" in message.body
    assert "http://127.0.0.1:8000/ssh/\n" in message.body
    [other] = [m for m in mail.outbox if m.to == ["ada@uni.example"]]
    assert "Download the new ssh config" in other.body

"""Granting, reconciling and revoking on the real sshd fleet, with the emulator as the
Cloud TPU API: "add milo to tpu5" ends with milo logging in with plain ssh."""

from __future__ import annotations

import datetime as dt
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.core import mail
from django.db import connection
from django.utils import timezone

from accounts.keys import add_key
from accounts.models import User
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tpus.models import AuditEvent, Grant, TpuVm
from tpus.services import inventory, sshconfig
from tpus.services.grants import grant_access, revoke_access
from tpus.services.labs import remove_member
from tpus.services.reconcile import reconcile_vm

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"


@dataclass
class Pod:
    fleet: object
    hosts: list
    lab: object
    admin: object
    milo: object
    vm: TpuVm
    key: Path
    dir: Path

    def fresh(self, user):
        return User.objects.select_related("unix_account").get(pk=user.pk)

    def write_config(self, user) -> tuple[Path, Path]:
        user = self.fresh(user)
        config, known = self.dir / "config", self.dir / "known_hosts"
        config.write_text(sshconfig.render_config(user))
        known.write_text(sshconfig.render_known_hosts(sshconfig.vms_for(user)))
        return config, known

    def ssh(self, host: str, command: str = "true", user=None) -> subprocess.CompletedProcess:
        """Plain `ssh tpu5` with the portal's config and known_hosts, strict checking."""
        config, known = self.write_config(user or self.milo)
        return subprocess.run(
            ["ssh", "-F", str(config), "-i", str(self.key), "-o", "IdentitiesOnly=yes",
             "-o", f"UserKnownHostsFile={known}", "-o", "StrictHostKeyChecking=yes",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
             host, command],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def run_as(self, host, uid: int, command: str) -> None:
        self.fleet.exec(
            host.name,
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             "sh", "-c", command],
        )  # fmt: skip

    def processes_of(self, host, uid: int) -> list[str]:
        out = self.fleet.exec(
            host.name, ["sh", "-c", f"ps -e -o pid=,ruid=,stat= | awk '$2 == {uid} && $3 !~ /^Z/'"]
        ).stdout.decode()
        return [line for line in out.splitlines() if line.strip()]


def _new_key(directory: Path, label: str) -> tuple[Path, str]:
    path = directory / f"id_{label}"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{label}@laptop", "-f", str(path)],
        check=True,
    )
    return path, path.with_suffix(".pub").read_text().strip()


@pytest.fixture
def pod(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, settings,
    tmp_path, make_lab, make_user, add_member,
) -> Pod:  # fmt: skip
    hosts = fleet_hosts(4)
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    key, public = _new_key(tmp_path, "milo")
    add_key(milo, public)
    milo = User.objects.get(pk=milo.pk)  # with the username just chosen
    mail.outbox.clear()
    return Pod(fleet, hosts, lab, admin, milo, vm, key, tmp_path)


def _grant(pod, capture, **options):
    with capture(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], **options)
    grant.refresh_from_db()
    return grant


def test_adding_milo_to_a_pod_lets_him_log_in_to_every_worker_with_plain_ssh(
    pod, django_capture_on_commit_callbacks
):
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    assert grant.state == "active", grant.error
    username = pod.fresh(pod.milo).unix_account.username
    for host in ("tpu5", "tpu5-w0", "tpu5-w1", "tpu5-w2", "tpu5-w3"):
        result = pod.ssh(host, "id -un; hostname")
        assert result.returncode == 0, (host, result.stderr)
        assert result.stdout.split()[0] == username
    # Each alias reaches its own worker.
    names = {pod.ssh(f"tpu5-w{i}", "hostname").stdout.strip() for i in range(4)}
    assert len(names) == 4
    [message] = [m for m in mail.outbox if m.to == ["milo@uni.example"]]
    assert "You can now use tpu5" in message.subject
    for host in pod.hosts:
        assert host.ip in message.body
    assert "Host tpu5" in message.body


def test_sudo_is_granted_only_when_asked(pod, django_capture_on_commit_callbacks):
    _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    assert pod.ssh("tpu5", "sudo -n true").returncode != 0
    _grant(pod, django_capture_on_commit_callbacks, sudo=True)
    assert pod.ssh("tpu5-w3", "sudo -n id -u").stdout.strip() == "0"


def test_a_second_reconcile_changes_nothing(pod, django_capture_on_commit_callbacks):
    _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    report = reconcile_vm(pod.vm.pk)
    assert report.complete
    assert report.changed == 0
    syncs = [w.sync.last_report["values"] for w in pod.vm.workers.select_related("sync")]
    assert all(v.get("noop") == "1" for v in syncs)


def test_revoking_locks_milo_out_and_kills_his_processes(pod, django_capture_on_commit_callbacks):
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=True)
    uid = pod.fresh(pod.milo).unix_account.uid
    for host in pod.hosts:
        pod.run_as(host, uid, "nohup sleep 1000 >/dev/null 2>&1 &")
        assert pod.processes_of(host, uid)
    config_before = pod.write_config(pod.milo)
    with django_capture_on_commit_callbacks(execute=True):
        revoke_access(pod.admin, grant)
    grant.refresh_from_db()
    assert grant.state == "revoked"
    for host in pod.hosts:
        assert pod.processes_of(host, uid) == []
    # Even with the config he had before, he cannot log in any more.
    config, known = config_before
    result = subprocess.run(
        ["ssh", "-F", str(config), "-i", str(pod.key), "-o", "IdentitiesOnly=yes",
         "-o", f"UserKnownHostsFile={known}", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
         "tpu5", "true"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode != 0
    assert any(m.to == ["milo@uni.example"] and "ended" in m.subject for m in mail.outbox)


def test_removing_milo_from_the_lab_revokes_his_access(pod, django_capture_on_commit_callbacks):
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    membership = pod.lab.memberships.get(user=pod.milo)
    with django_capture_on_commit_callbacks(execute=True):
        remove_member(pod.admin, membership)
    grant.refresh_from_db()
    assert grant.state == "revoked"
    assert pod.ssh("tpu5").returncode != 0


def test_a_new_key_reaches_every_worker(pod, django_capture_on_commit_callbacks):
    _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    new_key, public = _new_key(pod.dir, "milo2")
    with django_capture_on_commit_callbacks(execute=True):
        add_key(pod.milo, public)
    pod.key = new_key
    assert pod.ssh("tpu5-w2").returncode == 0


def test_a_worker_that_is_down_catches_up_when_it_returns(pod, django_capture_on_commit_callbacks):
    down = pod.hosts[2]
    pod.fleet.down(down.name, hang=False)
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    assert grant.state == "failed"
    assert "tpu5-w2" in grant.error or "unreachable" in grant.error.lower()
    # The others are done; nothing is half-written anywhere.
    assert pod.ssh("tpu5-w0").returncode == 0
    pod.fleet.start(down.name)
    report = reconcile_vm(pod.vm.pk)  # what the periodic sweep does
    assert report.complete
    grant.refresh_from_db()
    assert grant.state == "active"
    assert pod.ssh("tpu5-w2").returncode == 0


def test_a_changed_host_key_stops_provisioning_and_alerts_the_admins(
    pod, django_capture_on_commit_callbacks
):
    changed = pod.hosts[1]
    pod.fleet.rekey(changed.name)
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    assert grant.state == "failed"
    worker = pod.vm.workers.get(index=1)
    assert worker.host_key_mismatch_at is not None
    assert worker.presented_host_key
    alert = [m for m in mail.outbox if "Host key of tpu5-w1 changed" in m.subject]
    assert alert and alert[0].to == ["boss@vision.example"]
    assert AuditEvent.objects.filter(action="vm.host_key_changed").count() == 1
    # The pin is unchanged: a changed key is never accepted by itself.
    assert worker.host_keys == pod.vm.workers.get(index=1).host_keys


@pytest.mark.django_db(transaction=True)
def test_fifty_clicks_at_once_give_one_grant_and_one_result(pod):
    if connection.vendor == "sqlite":
        pytest.skip("concurrent writers need PostgreSQL (PORTAL_TEST_BACKEND=services)")
    barrier = threading.Barrier(10)
    errors = []

    def click():
        try:
            barrier.wait()
            for _ in range(5):
                grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
        except Exception as exc:  # collected, then asserted empty
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=click) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert Grant.objects.filter(user=pod.milo, vm=pod.vm).count() == 1
    reconcile_vm(pod.vm.pk)
    assert Grant.objects.get(user=pod.milo, vm=pod.vm).state == "active"
    assert pod.ssh("tpu5").returncode == 0


def test_an_account_the_portal_did_not_make_is_reported_once(
    pod, django_capture_on_commit_callbacks, settings
):
    _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    stranger_uid = settings.PORTAL_UID_MAX
    host = pod.hosts[0]
    pod.fleet.exec(host.name, ["useradd", "-u", str(stranger_uid), "-M", "stranger"])
    try:
        with django_capture_on_commit_callbacks(execute=True):
            reconcile_vm(pod.vm.pk)
            reconcile_vm(pod.vm.pk)
        alerts = [m for m in mail.outbox if "Unknown accounts on tpu5-w0" in m.subject]
        assert len(alerts) == 1
        assert "stranger" in alerts[0].body
        # Reported, never removed.
        assert (
            pod.fleet.exec(host.name, ["id", "-u", "stranger"]).stdout.strip()
            == str(stranger_uid).encode()
        )
    finally:
        pod.fleet.exec(host.name, ["userdel", "stranger"], check=False)


def test_after_an_ip_change_the_refreshed_config_works_and_the_old_one_cannot_reach_another_host(
    pod, django_capture_on_commit_callbacks, tpu_emulator
):
    from tpus.services.sync import sync_inventory

    _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    config, known = pod.write_config(pod.milo)
    old_config, old_known = pod.dir / "old_config", pod.dir / "old_known_hosts"
    old_config.write_text(config.read_text())
    old_known.write_text(known.read_text())
    first, other = pod.hosts[0], pod.hosts[1]
    old_ip = first.ip
    new_ip = pod.fleet.move(first.name, pod.fleet.free_ip())
    tpu_emulator.controls.set_ip("tpu5", 0, new_ip)
    mail.outbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        report = sync_inventory()
    assert report.ip_changes == 1
    notices = [m for m in mail.outbox if new_ip in m.subject]
    assert [m.to for m in notices] == [["milo@uni.example"]]
    assert pod.ssh("tpu5", "hostname").returncode == 0
    # Another machine now answers at the old address: the pinned key refuses it.
    pod.fleet.move(other.name, old_ip)
    result = subprocess.run(
        ["ssh", "-F", str(old_config), "-i", str(pod.key), "-o", "IdentitiesOnly=yes",
         "-o", f"UserKnownHostsFile={old_known}", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=5", "tpu5", "true"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode != 0
    assert "IDENTIFICATION HAS CHANGED" in result.stderr or "verification failed" in result.stderr


def test_the_reconcile_checks_membership_again_whatever_the_grant_says(
    pod, django_capture_on_commit_callbacks
):
    grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
    # Someone removed milo behind the services' back (say, in the database console).
    pod.lab.memberships.filter(user=pod.milo).update(state="removed")
    reconcile_vm(pod.vm.pk)
    grant.refresh_from_db()
    assert grant.state == "active"  # the row is unchanged...
    assert pod.ssh("tpu5").returncode != 0  # ...but the hosts lock him out


def test_a_host_key_alarm_clears_itself_once_the_real_host_is_back(
    pod, django_capture_on_commit_callbacks
):
    real = pod.hosts[1]
    spares = [h for h in pod.fleet.hosts.values() if h not in pod.hosts]
    if not spares:
        pytest.fail("this test needs a fleet host outside the pod: set TESTFLEET_HOSTS >= 5")
    impostor = spares[0]
    address = real.ip
    try:
        # The worker's address now answers with another machine.
        pod.fleet.move(real.name, pod.fleet.free_ip())
        pod.fleet.move(impostor.name, address)
        grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
        assert grant.state == "failed"
        assert pod.vm.workers.get(index=1).host_key_mismatch_at is not None
        assert pod.fleet.exec(impostor.name, ["getent", "passwd", "tpu-portal"], check=False)
        # The address comes back to the real host, whose key matches the pin.
        pod.fleet.move(impostor.name, pod.fleet.free_ip())
        pod.fleet.move(real.name, address)
        report = reconcile_vm(pod.vm.pk)  # what the sweep does
        assert report.complete, report
        worker = pod.vm.workers.get(index=1)
        assert worker.host_key_mismatch_at is None and worker.presented_host_key == ""
        assert AuditEvent.objects.filter(action="vm.host_key_alarm_cleared").count() == 1
        grant.refresh_from_db()
        assert grant.state == "active", grant.error
        assert pod.ssh("tpu5-w1").returncode == 0
    finally:
        pod.fleet.heal(impostor.name)


def test_a_local_account_on_the_persons_uid_fails_the_grant_until_it_is_gone(
    pod, django_capture_on_commit_callbacks
):
    from tpus.services.maintenance import vms_to_reconcile

    uid = pod.fresh(pod.milo).unix_account.uid
    blocked = pod.hosts[2]
    # As Google's guest agent or an admin's useradd might: a local account on that number.
    pod.fleet.exec(blocked.name, ["useradd", "-M", "-u", str(uid), "localops"])
    try:
        grant = _grant(pod, django_capture_on_commit_callbacks, sudo=False)
        assert grant.state == "failed"
        assert "tpu5-w2 refused" in grant.error and "localops" in grant.error
        assert "tries again by itself" in grant.error
        assert grant.retry_at is not None and grant.failures == 1
        # Still there at the next try: a second failure, further off, and no second email.
        Grant.objects.filter(pk=grant.pk).update(retry_at=timezone.now())
        assert pod.vm.pk in vms_to_reconcile()
        reconcile_vm(pod.vm.pk)
        grant.refresh_from_db()
        assert grant.state == "failed" and grant.failures == 2
        assert grant.retry_at > timezone.now() + dt.timedelta(seconds=20)
        failed_mails = [m for m in mail.outbox if m.subject.endswith("failed")]
        assert len(failed_mails) == 1
    finally:
        pod.fleet.exec(blocked.name, ["userdel", "localops"], check=False)
    # Once the admin removed it, the sweep's next try succeeds without anyone clicking.
    Grant.objects.filter(pk=grant.pk).update(retry_at=timezone.now())
    assert pod.vm.pk in vms_to_reconcile()
    reconcile_vm(pod.vm.pk)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert grant.retry_at is None and grant.error == ""
    assert pod.ssh("tpu5-w2").returncode == 0


def test_the_api_says_which_worker_holds_a_grant_up_and_why(pod, client):
    from accounts.services import create_token

    down = pod.hosts[3]
    pod.fleet.down(down.name, hang=False)
    [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    reconcile_vm(pod.vm.pk)  # one run, as the first task's; the retries come later
    token = create_token(pod.admin, "t")[1]
    response = client.get(
        f"/api/v1/labs/{pod.lab.slug}/grants?vm=tpu5", HTTP_AUTHORIZATION=f"Bearer {token}"
    )
    [body] = response.json()["items"]
    assert body["state"] == "pending"
    assert (body["workers_applied"], body["workers_total"]) == (3, 4)
    [stuck] = body["workers"]  # only the one holding the grant up
    assert (stuck["alias"], stuck["state"]) == ("tpu5-w3", "retrying")
    assert stuck["error"] and stuck["last_attempt_at"]
    assert body["error"].startswith("tpu5-w3 (retrying): ")
    # Milo sees the same about his own access.
    mine = client.get(
        "/api/v1/me/grants", HTTP_AUTHORIZATION=f"Bearer {create_token(pod.milo, 't')[1]}"
    )
    assert mine.json()["items"][0]["workers"] == body["workers"]

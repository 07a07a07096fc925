"""TPU VMs the portal makes, on real hosts: the emulator makes new nodes of the fleet's
hosts, a queued spot v4-32 in a stockout comes up when capacity is released, connected
from its creation (the guest agent puts the lab's key on every host from the node's
metadata) with the hosts' real host keys pinned; preempted and kept alive, it comes
back on machines made new, with their new keys pinned and no alarm."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from django.utils import timezone

from accounts.keys import add_key
from accounts.unix import choose_username
from portal.models import OutboxMessage
from testfleet.guestagent import apply_once, offer_hosts
from tpus.cloud import NodeRequest
from tpus.models import Job, LabAllowance, TpuVm, VmConnection, VmRequest, Worker
from tpus.services import (
    connect,
    inventory,
    job_engine,
    jobs,
    keep_alive,
    reconcile,
    sync,
    vm_request_work,
    vm_requests,
)
from tpus.services.grants import grant_access
from tpus.services.hosts import hosts_must_change
from tpus.services.vm_requests import VmSpec
from tpus.tests.test_jobs_host import JAX_ENV

pytestmark = pytest.mark.fleet

PROJECT = "vision-project"
ZONE = "us-central2-b"


@pytest.fixture
def scene(tpu_emulator, fleet, fleet_hosts, fleet_settings, guest_agent, cast, settings):
    settings.PORTAL_CONNECT_WAIT_SECONDS = 30
    settings.PORTAL_CONNECT_POLL_SECONDS = 0.3
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=16)
    hosts = fleet_hosts(4)
    offer_hosts(fleet, tpu_emulator.controls.store, [h.name for h in hosts])
    return lab, hosts


def _connected(vm: TpuVm) -> VmConnection:
    """Run the connection's checks one after another, each when it is due, as a worker
    runs the tasks they queue (inside the test's transaction those never leave)."""
    connection = VmConnection.objects.get(vm=vm)
    while connection.state == "connecting":
        connect.check_connection(connection.pk, connection.attempt, connection.checks)
        connection.refresh_from_db()
        if connection.next_check_at is not None:
            time.sleep(max(0.0, (connection.next_check_at - timezone.now()).total_seconds()))
    return connection


def test_a_queued_spot_pod_comes_up_on_fleet_hosts_connected_and_pinned(
    scene, cast, tpu_emulator, fleet
):
    lab, hosts = scene
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    spec = VmSpec(
        name="tpu5",
        zone=ZONE,
        accelerator_type="v4-32",
        runtime_version="tpu-ubuntu2204-base",
        provisioning="spot",
        queued=True,
        keep_alive=True,
    )
    made = vm_requests.request_vm(cast.admin, lab, spec)
    vm_request_work.send(made.pk)
    assert VmRequest.objects.get(pk=made.pk).state == "waiting"

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    workers = list(vm.workers.order_by("index"))
    assert sorted(w.external_ip for w in workers) == sorted(h.ip for h in hosts)
    by_ip = {h.ip: h.name for h in hosts}
    for worker in workers:  # the hosts' real keys, pinned from the guest attributes
        assert sorted(worker.host_keys) == sorted(fleet.host_keys(by_ip[worker.external_ip]))
    assert _connected(vm).state == "connected"
    first_keys = {w.index: sorted(w.host_keys) for w in workers}

    # Google preempts it; kept alive, it is asked for again and made of new machines.
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    [again] = keep_alive.bring_back()
    # The guest agent's pass makes the released hosts new machines and offers them again.
    assert tpu_emulator.controls.released_hosts()
    deadline = time.monotonic() + 60
    while tpu_emulator.controls.released_hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tpu_emulator.controls.released_hosts()
    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "ready"
    vm.refresh_from_db()
    for worker in vm.workers.all():
        assert sorted(worker.host_keys) == sorted(fleet.host_keys(by_ip[worker.external_ip]))
        assert worker.host_key_mismatch_at is None
        assert sorted(worker.host_keys) != first_keys[worker.index]  # machines made new
    assert _connected(vm).state == "connected"


@pytest.fixture
def loop_device(tmp_path):
    """An ext4 image on a loop device of this machine; the test plugs it into hosts."""
    image = tmp_path / "scratch.img"
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    loop = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    yield loop
    subprocess.run(["losetup", "-d", loop], check=False)


def _plug(fleet, hosts, loop: str, name: str) -> None:
    """The disk's device appears on each host, as Google attaches it to each worker."""
    rdev = os.stat(loop).st_rdev
    script = (
        f"[ -e {loop} ] || mknod -m 660 {loop} b {os.major(rdev)} {os.minor(rdev)}; "
        f"mkdir -p /dev/disk/by-id && ln -sf {loop} /dev/disk/by-id/google-{name}"
    )
    for host in hosts:
        fleet.exec(host.name, ["sh", "-c", script])


def _mounted(fleet, host, point: str) -> str:
    done = fleet.exec(host.name, ["sh", "-c", f"findmnt -n -o SOURCE {point}; true"])
    return done.stdout.decode().strip()


def test_a_preempted_pod_comes_back_with_its_disk_mounted_again_on_every_worker(
    scene, cast, tpu_emulator, fleet, loop_device
):
    lab, hosts = scene
    spec = VmSpec(
        name="tpu5", zone=ZONE, accelerator_type="v4-32", runtime_version="tpu-ubuntu2204-base",
        provisioning="spot", queued=True, keep_alive=True,
    )  # fmt: skip
    made = vm_requests.request_vm(cast.admin, lab, spec)
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    disk = inventory.register_disk(
        cast.admin, lab, name="scratch", zone=ZONE, size_gb=1, mount_point="/scratch"
    )
    inventory.attach_disk(cast.admin, disk, vm, "READ_ONLY")
    assert _connected(vm).state == "connected"
    _plug(fleet, hosts, loop_device, "scratch")
    report = reconcile.reconcile_vm(vm.pk)
    assert report.complete, report
    assert all(_mounted(fleet, h, "/scratch") for h in hosts)

    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    [again] = keep_alive.bring_back()
    deadline = time.monotonic() + 60
    while tpu_emulator.controls.released_hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "ready"
    # New machines: nothing mounted until the portal mounts it again.
    assert not any(_mounted(fleet, h, "/scratch") for h in hosts)
    node = tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5")
    assert [(d.name, d.mode) for d in node.data_disks] == [("scratch", "READ_ONLY")]
    assert _connected(vm).state == "connected"
    _plug(fleet, hosts, loop_device, "scratch")
    report = reconcile.reconcile_vm(vm.pk)
    assert report.complete, report
    assert all(_mounted(fleet, h, "/scratch") == loop_device for h in hosts)
    vm.refresh_from_db()
    assert vm.restore_version is None and vm.restored_at is not None


def _with_access(cast, lab, vm, fleet_username, tmp_path, capture):
    """Milo (the cast's member) with a key and access to ``vm`` in force."""
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    choose_username(cast.member, fleet_username)
    add_key(cast.member, key.with_suffix(".pub").read_text().strip())
    with capture(execute=True):
        [grant] = grant_access(cast.admin, lab, cast.member, [vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    return type(cast.member).objects.select_related("unix_account").get(pk=cast.member.pk)


def _alerts():
    return OutboxMessage.objects.filter(kind="host_key_changed")


def _remake_at_the_same_addresses(tpu_emulator, lab, hosts) -> None:
    """What Google does to a spot VM: the node is deleted with its machines and made
    again of new ones, at the same addresses, by Google, not by the portal."""
    client = tpu_emulator.client
    client.delete_node(PROJECT, ZONE, "tpu5")
    deadline = time.monotonic() + 60
    while tpu_emulator.controls.released_hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    node = client.create_node(
        PROJECT,
        NodeRequest(
            name="tpu5", zone=ZONE, accelerator_type="v4-32",
            runtime_version="tpu-ubuntu2204-base", provisioning="spot",
            metadata=vm_request_work.key_metadata(lab),
        ),
    )  # fmt: skip
    assert sorted(w.external_ip for w in node.workers) == sorted(h.ip for h in hosts)


def test_a_pod_made_anew_at_the_same_addresses_is_restored_with_no_alarm_before_any_sync(
    scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    lab, hosts = scene
    made = vm_requests.request_vm(cast.admin, lab, _spot_pod())
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    assert _connected(vm).state == "connected"
    milo = _with_access(cast, lab, vm, fleet_username, tmp_path, django_capture_on_commit_callbacks)
    username = milo.unix_account.username
    home = f"/home/{username}"
    for host in hosts:  # the fleet's CPU build of JAX, as the job's environment
        fleet.exec(
            host.name,
            ["sh", "-c", f"ln -sfn {JAX_ENV} {home}/jax && chown -h {username}: {home}/jax"],
        )
    spec = jobs.JobSpec(args=["sleep", "300"], python="~/jax", rerun_after_preemption=True)
    job = jobs.submit_job(milo, vm, spec)
    job_engine.advance(vm.pk)
    job.refresh_from_db()
    assert job.state == "running", job.reason

    _remake_at_the_same_addresses(tpu_emulator, lab, hosts)
    # The job poll reaches the new machines first, then a reconcile; no sync yet.
    with django_capture_on_commit_callbacks(execute=True):
        job_engine.advance(vm.pk)
    job.refresh_from_db()
    assert job.state == "lost" and "made anew" in job.reason
    with django_capture_on_commit_callbacks(execute=True):
        reconcile.reconcile_vm(vm.pk)
    assert not Worker.objects.filter(vm=vm, host_key_mismatch_at__isnull=False).exists()
    assert not _alerts().exists()
    by_ip = {h.ip: h.name for h in hosts}
    for worker in vm.workers.all():  # pinned again, from what the new machines publish
        assert sorted(worker.host_keys) == sorted(fleet.host_keys(by_ip[worker.external_ip]))
    for host in hosts:  # milo's account is back on every new machine
        assert fleet.exec(host.name, ["id", "-un", username]).stdout.decode().strip() == username
    vm.refresh_from_db()
    assert vm.restore_version is None and vm.restored_at is not None
    assert Job.objects.filter(rerun_of=job, state="queued").exists()
    # The sync that comes later sees nothing to alarm about either.
    sync.sync_inventory([lab])
    assert not _alerts().exists()
    assert not Worker.objects.filter(vm=vm, host_key_mismatch_at__isnull=False).exists()


def test_a_worker_of_a_node_not_made_anew_that_presents_another_key_stops_and_alarms(
    scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    lab, hosts = scene
    made = vm_requests.request_vm(cast.admin, lab, _spot_pod())
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    assert _connected(vm).state == "connected"
    _with_access(cast, lab, vm, fleet_username, tmp_path, django_capture_on_commit_callbacks)
    worker = vm.workers.get(index=0)
    fleet.renew({h.ip: h.name for h in hosts}[worker.external_ip])  # same node, new key
    with django_capture_on_commit_callbacks(execute=True):
        hosts_must_change(vm, "a change")
    worker.refresh_from_db()
    assert worker.host_key_mismatch_at is not None and not worker.host_key_alarm_published
    assert _alerts().count() == 1
    assert TpuVm.objects.get(pk=vm.pk).restore_version is None


def _spot_pod() -> VmSpec:
    return VmSpec(
        name="tpu5", zone=ZONE, accelerator_type="v4-32", runtime_version="tpu-ubuntu2204-base",
        provisioning="spot", queued=True,
    )  # fmt: skip


@pytest.fixture
def agentless_scene(tpu_emulator, fleet, fleet_hosts, fleet_settings, cast, settings):
    """The scene without Google's guest agent running: the test applies the nodes'
    ``ssh-keys`` itself, so it can act while a new VM's workers do not have the lab's
    key yet."""
    settings.PORTAL_CONNECT_WAIT_SECONDS = 30
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=16)
    hosts = fleet_hosts(4)
    offer_hosts(fleet, tpu_emulator.controls.store, [h.name for h in hosts])
    return lab, hosts


def test_a_grant_on_a_vm_still_taking_the_lab_key_waits_for_it_with_no_alarm(
    agentless_scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    lab, hosts = agentless_scene
    # A direct create: the VM is in the lab, connecting; seconds later, a grant; the
    # workers do not take the lab's key yet.
    vm, grant = _connecting_with_a_grant(
        cast, lab, tmp_path, fleet_username, django_capture_on_commit_callbacks
    )
    assert VmConnection.objects.get(vm=vm).state == "connecting"
    report = reconcile.reconcile_vm(vm.pk)
    assert sorted(report.retryable) == [0, 1, 2, 3] and not report.failed
    grant.refresh_from_db()
    assert grant.state == "pending", grant.error
    assert not OutboxMessage.objects.exists()  # nobody told of a failure

    assert report.waiting_for_key  # the task looks again in a second

    # The guest agent puts the key in place; the next look reaches every worker: the
    # grant goes active (the only email), and the VM is connected by that reconcile,
    # with no reconcile more asked for.
    apply_once(fleet, tpu_emulator.controls.show())
    version = TpuVm.objects.get(pk=vm.pk).desired_version
    with django_capture_on_commit_callbacks(execute=True):
        report = reconcile.reconcile_vm(vm.pk)
    assert report.complete and not report.waiting_for_key
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert [m.kind for m in OutboxMessage.objects.all()] == ["access_active"]
    assert VmConnection.objects.get(vm=vm).state == "connected"
    assert TpuVm.objects.get(pk=vm.pk).desired_version == version


def _connecting_with_a_grant(cast, lab, tmp_path, fleet_username, captured):
    """A VM just made, connecting, and a grant on it whose change no worker has yet."""
    spec = VmSpec(
        name="tpu5", zone=ZONE, accelerator_type="v4-32", runtime_version="tpu-ubuntu2204-base",
        provisioning="spot",
    )  # fmt: skip
    with captured(execute=False):
        made = vm_requests.request_vm(cast.admin, lab, spec)
        vm_request_work.send(made.pk)  # a direct create: the VM is in the lab, connecting
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    choose_username(cast.member, fleet_username)
    add_key(cast.member, key.with_suffix(".pub").read_text().strip())
    with captured(execute=False):
        [grant] = grant_access(cast.admin, lab, cast.member, [vm], sudo=False)
    return vm, grant


RECONCILE = "tpus.tasks.reconcile_vm"


def _check_sees_the_key_as_the_first_run_ends(monkeypatch, fleet, tpu_emulator, vm, captured):
    """The VM's connection check sees every worker take the lab's key while the first
    reconcile run settles (the guest agent applies the key just before); each run's
    end is counted."""
    settle, runs = reconcile.settle_grants, []

    def settle_after_the_check(vm_id: int, **kwargs) -> bool:
        runs.append(vm_id)
        if len(runs) == 1:
            apply_once(fleet, tpu_emulator.controls.show())
            connection = VmConnection.objects.get(vm=vm)
            with captured(execute=True):
                connect.check_connection(connection.pk, connection.attempt, connection.checks)
            assert VmConnection.objects.get(vm=vm).state == "connected"
        return settle(vm_id, **kwargs)

    monkeypatch.setattr(reconcile, "settle_grants", settle_after_the_check)
    return runs


def test_a_run_refused_the_key_runs_again_at_once_when_the_check_sees_it_taken(
    agentless_scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    monkeypatch, django_capture_on_commit_callbacks, queued_tasks,
):  # fmt: skip
    lab, hosts = agentless_scene
    captured = django_capture_on_commit_callbacks
    vm, grant = _connecting_with_a_grant(cast, lab, tmp_path, fleet_username, captured)
    version = TpuVm.objects.get(pk=vm.pk).desired_version
    queued_tasks.take(RECONCILE)
    runs = _check_sees_the_key_as_the_first_run_ends(monkeypatch, fleet, tpu_emulator, vm, captured)

    # The first run's logins are refused (no worker has the key yet); the check sees
    # every worker take it before that run ends: the same reconcile runs again at once,
    # not a second later, and the grant is in force when it returns.
    report = reconcile.reconcile_vm(vm.pk)
    assert len(runs) == 2
    assert report.complete and not report.waiting_for_key
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    # The check asked for a reconcile (which finds this one under way) and for no new
    # version: nothing the workers hold changed.
    assert queued_tasks.take(RECONCILE) == [((vm.pk,), None)]
    assert TpuVm.objects.get(pk=vm.pk).desired_version == version


def test_a_run_that_logged_in_does_not_run_again_when_the_check_ends_during_it(
    agentless_scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    monkeypatch, django_capture_on_commit_callbacks,
):  # fmt: skip
    lab, hosts = agentless_scene
    captured = django_capture_on_commit_callbacks
    vm, grant = _connecting_with_a_grant(cast, lab, tmp_path, fleet_username, captured)
    apply_once(fleet, tpu_emulator.controls.show())  # the key is there before the run
    version = TpuVm.objects.get(pk=vm.pk).desired_version
    runs = _check_sees_the_key_as_the_first_run_ends(monkeypatch, fleet, tpu_emulator, vm, captured)

    # The run logged in everywhere and made the account; the check, ending meanwhile,
    # changes nothing the workers must hold: no second run beside a job's start.
    report = reconcile.reconcile_vm(vm.pk)
    assert runs == [vm.pk]
    assert report.complete
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert TpuVm.objects.get(pk=vm.pk).desired_version == version

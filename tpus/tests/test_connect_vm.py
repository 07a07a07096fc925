"""Connect and Disconnect end to end: the emulated Cloud TPU API, real sshd workers,
and a guest agent that applies the node's ``ssh-keys`` metadata to them, as Google's
does on a TPU VM."""

from __future__ import annotations

import time

import pytest

from testfleet.fixtures import add_fleet_node
from tpus.models import AuditAction, AuditEvent, ConnectionState, VmConnection
from tpus.remote import HostKeyPins, RemoteError, run_script
from tpus.remote import Worker as RemoteWorker
from tpus.services import connect, inventory
from tpus.services.connect import ConnectError
from tpus.services.labkeys import lab_key, login_for

pytestmark = pytest.mark.fleet
PROJECT = "vision-project"
ZONE = "us-central1-f"
THEIRS = "alice:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAliceBlob alice@laptop\n"
CAROL = "carol:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICarolBlob carol@desk"


@pytest.fixture
def scene(tpu_emulator, fleet, fleet_hosts, fleet_settings, guest_agent, cast, settings):
    settings.PORTAL_CONNECT_WAIT_SECONDS = 20
    settings.PORTAL_CONNECT_POLL_SECONDS = 0.3
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    hosts = fleet_hosts(2)
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    tpu_emulator.controls.set_metadata(
        "tpu5", {"ssh-keys": THEIRS, "startup-script": "#!/bin/sh\necho hi\n"}
    )
    [vm] = inventory.import_vms(cast.admin, lab, [f"{ZONE}/tpu5"])
    return tpu_emulator, cast.admin, vm


def _accepts(worker, lab) -> bool:
    remote = RemoteWorker(
        address=worker.external_ip,
        pins=HostKeyPins.parse(worker.host_keys),
        name=worker.alias,
        login=login_for(lab),
    )
    try:
        run_script(remote, "whoami.sh", keep=False)  # a new login, as a person's
    except RemoteError as error:
        # The guest agent empties the key file, then takes the account out of
        # google-sudoers: a login that got in between the two finds sudo gone.
        refused = error.kind == RemoteError.AUTH or "a password is required" in str(error)
        assert refused, error
        return False
    return True


def _connect(admin, vm, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        connect.connect_vm(admin, vm)
    return VmConnection.objects.get(vm=vm)


def test_connect_waits_until_every_worker_accepts_the_lab_key_and_keeps_other_metadata(
    scene, django_capture_on_commit_callbacks
):
    emulator, admin, vm = scene
    emulator.controls.change_metadata_after_next_get("tpu5", {"ssh-keys": THEIRS + CAROL})

    connection = _connect(admin, vm, django_capture_on_commit_callbacks)

    assert connection.state == ConnectionState.CONNECTED, connection.reason
    assert {w["state"] for w in connection.workers.values()} == {"accepted"}
    assert len(connection.workers) == 2
    metadata = emulator.controls.metadata("tpu5")
    line = f"tpu-portal:{lab_key(vm.lab).public_line}"
    # The concurrent change (carol's line) survived; ours came after it.
    assert metadata["ssh-keys"] == THEIRS + CAROL + "\n" + line
    assert metadata["startup-script"] == "#!/bin/sh\necho hi\n"
    actions = set(AuditEvent.objects.filter(lab=vm.lab).values_list("action", flat=True))
    assert {AuditAction.VM_CONNECT_REQUESTED, AuditAction.VM_CONNECTED} <= actions


def test_disconnect_removes_only_our_line_and_the_workers_refuse_the_key_after(
    scene, django_capture_on_commit_callbacks, settings
):
    emulator, admin, vm = scene
    _connect(admin, vm, django_capture_on_commit_callbacks)

    connect.disconnect_vm(admin, vm)

    assert emulator.controls.metadata("tpu5")["ssh-keys"] == THEIRS
    assert VmConnection.objects.get(vm=vm).state == ConnectionState.DISCONNECTED
    assert AuditEvent.objects.filter(action=AuditAction.VM_DISCONNECTED).exists()
    # The guest agent takes the key away: the lab's login is refused on every worker.
    deadline = time.monotonic() + 15
    while any(_accepts(worker, vm.lab) for worker in vm.workers.all()):
        assert time.monotonic() < deadline, "a worker still accepts the lab key"
        time.sleep(0.3)
    # With OS Login on for the project (which the TPU API does not show), the key is
    # added but never accepted, and the wait ends with the explanation.
    settings.PORTAL_CONNECT_WAIT_SECONDS = 3
    emulator.controls.set_oslogin(PROJECT, True)
    connection = _connect(admin, vm, django_capture_on_commit_callbacks)
    assert connection.state == ConnectionState.FAILED
    assert "OS Login is enabled for the project" in connection.reason
    assert "guest agent" in connection.reason
    assert {w["state"] for w in connection.workers.values()} == {"refused"}


def test_a_node_with_os_login_in_its_metadata_is_refused_with_what_to_change(scene):
    emulator, admin, vm = scene
    emulator.controls.set_metadata("tpu5", {"enable-oslogin": "TRUE"})

    with pytest.raises(ConnectError) as caught:
        connect.connect_vm(admin, vm)

    assert "OS Login is enabled on tpu5" in str(caught.value)
    assert "--update-metadata=enable-oslogin=FALSE" in str(caught.value)
    assert emulator.controls.metadata("tpu5")["ssh-keys"] == THEIRS
    # The reason stays the connection's, for the VM's page (not only a passing message).
    connection = VmConnection.objects.get(vm=vm)
    assert connection.state == ConnectionState.FAILED
    assert connection.reason == str(caught.value) and connection.workers == {}
    assert AuditEvent.objects.filter(action=AuditAction.VM_CONNECT_FAILED).count() == 1


def test_the_vm_page_keeps_the_reason_connect_was_refused_up_front(scene, client):
    from django.urls import reverse

    emulator, admin, vm = scene
    emulator.controls.set_metadata("tpu5", {"enable-oslogin": "TRUE"})
    client.force_login(admin)

    client.post(reverse("vm_connect", args=[vm.lab.slug, vm.pk]))

    for _ in range(2):  # the page after the redirect, and any later visit
        page = client.get(reverse("vm_detail", args=[vm.lab.slug, vm.pk])).content.decode()
        assert "OS Login is enabled on tpu5" in page
        assert "enable-oslogin=FALSE" in page
        assert "Failed" in page


def test_a_node_the_portal_may_not_update_gets_the_permission_message(scene):
    emulator, admin, vm = scene
    emulator.controls.deny_update("tpu5")

    with pytest.raises(ConnectError) as caught:
        connect.connect_vm(admin, vm)

    assert str(caught.value).startswith(
        f"The portal's service account lacks tpu.nodes.update on {PROJECT}"
    )
    assert emulator.controls.metadata("tpu5")["ssh-keys"] == THEIRS


def test_a_vm_registered_by_hand_and_a_non_admin_are_refused(scene, cast):
    emulator, admin, vm = scene
    with pytest.raises(ConnectError, match="Only the lab's admins"):
        connect.connect_vm(cast.member, vm)
    vm.source = "manual"
    vm.save()
    with pytest.raises(ConnectError, match="registered by hand"):
        connect.connect_vm(admin, vm)
    assert emulator.controls.metadata("tpu5")["ssh-keys"] == THEIRS


def test_the_api_connects_and_shows_per_worker_progress_and_the_manual_route(
    scene, client, django_capture_on_commit_callbacks
):
    emulator, admin, vm = scene
    client.force_login(admin)
    base = f"/api/v1/labs/{vm.lab.slug}/vms/{vm.pk}"

    with django_capture_on_commit_callbacks(execute=True):
        started = client.post(f"{base}/connect")
    state = client.get(f"{base}/connection").json()

    assert started.status_code == 202
    assert state["state"] == "connected", state["reason"]
    assert set(state["workers"]) == {"0", "1"}
    assert state["public_key_line"] == f"tpu-portal:{lab_key(vm.lab).public_line}"
    assert (
        f"--zone={ZONE} --project={PROJECT} --update-metadata=ssh-keys="
        in (state["gcloud_command"])
    )
    page = client.get(f"/labs/{vm.lab.slug}/vms/{vm.pk}/").content.decode()
    assert state["public_key_line"] in page
    # Connected: checking again is offered, not as the page's primary action.
    assert '<button type="submit" class="secondary"' in page and "Connect again" in page
    assert "Connect this VM" not in page


def test_a_lab_on_the_site_key_has_nothing_to_connect(make_lab, make_user, add_member):
    from tpus.models import TpuVm
    from tpus.services import connect, labkeys

    lab = make_lab()
    admin = make_user()
    add_member(lab, admin, role="admin")
    labkeys.set_uses_site_key(make_user(is_staff=True, is_superuser=True), lab, True)
    lab.refresh_from_db()
    vm = TpuVm.objects.create(lab=lab, name="tpu7", zone="us-central1-f", source="imported")
    with pytest.raises(connect.ConnectError, match="site-wide SSH key"):
        connect.connect_vm(admin, vm)


CHECK = "tpus.tasks.check_vm_connection"


def test_a_check_looks_once_and_queues_the_next_while_the_workers_refuse_the_key(
    scene, django_capture_on_commit_callbacks, settings, queued_tasks
):
    from tpus.tasks import check_vm_connection

    emulator, admin, vm = scene
    settings.PORTAL_CONNECT_WAIT_SECONDS = 4
    emulator.controls.set_oslogin(PROJECT, True)  # the key never becomes a login
    with django_capture_on_commit_callbacks(execute=True):
        connect.connect_vm(admin, vm)
    [(args, countdown)] = queued_tasks.take(CHECK)
    assert countdown is None

    took, looks = [], 0
    while True:
        started = time.monotonic()
        with django_capture_on_commit_callbacks(execute=True):
            check_vm_connection.apply(args)
        took.append(time.monotonic() - started)
        connection = VmConnection.objects.get(vm=vm)
        looks += 1
        if connection.state != ConnectionState.CONNECTING:
            break
        # Not there yet: the check recorded what each worker said, and queued the next
        # look for later instead of waiting for it.
        assert {w["state"] for w in connection.workers.values()} == {"refused"}
        [(args, countdown)] = queued_tasks.take(CHECK)
        assert args == (connection.pk, connection.attempt, looks)
        assert 0 < countdown <= settings.PORTAL_CONNECT_POLL_SECONDS
        time.sleep(countdown)

    # Each look came back without waiting for the wait to be over (a look that waited
    # would take all of its 4 s; a loaded machine may stretch a look past 1 s); the wait
    # as a whole still ends as it did, failed with the reason, once
    # PORTAL_CONNECT_WAIT_SECONDS passed (the last look may end a moment after it).
    assert max(took) < settings.PORTAL_CONNECT_WAIT_SECONDS / 2, took
    assert looks >= 4
    assert connection.state == ConnectionState.FAILED
    assert connection.reason == connect.WHY_REFUSED
    waited = (connection.finished_at - connection.started_at).total_seconds()
    wait = settings.PORTAL_CONNECT_WAIT_SECONDS
    # It ends with the first look after the wait: no later than that look's own time.
    low, high = wait - settings.PORTAL_CONNECT_POLL_SECONDS - 0.5, wait + took[-1] + 0.5
    assert low <= waited <= high, (waited, took)
    assert queued_tasks.take(CHECK) == []


def test_a_check_queued_twice_looks_once(scene, django_capture_on_commit_callbacks, queued_tasks):
    emulator, admin, vm = scene
    emulator.controls.set_oslogin(PROJECT, True)
    with django_capture_on_commit_callbacks(execute=True):
        connect.connect_vm(admin, vm)
    [((connection_id, attempt, check), _)] = queued_tasks.take(CHECK)

    for _ in range(2):  # the task, and the same task again (the sweep found it late)
        with django_capture_on_commit_callbacks(execute=True):
            connect.check_connection(connection_id, attempt, check)

    assert VmConnection.objects.get(pk=connection_id).checks == 1
    assert len(queued_tasks.take(CHECK)) == 1  # one chain of looks goes on, not two
    # A look of an earlier attempt (Connect pressed again meanwhile) does nothing.
    with django_capture_on_commit_callbacks(execute=True):
        connect.check_connection(connection_id, attempt - 1, 1)
    assert VmConnection.objects.get(pk=connection_id).checks == 1


def test_a_labs_checks_try_their_workers_one_vm_at_a_time(
    scene, django_capture_on_commit_callbacks, queued_tasks
):
    import datetime as dt

    from django.utils import timezone

    from tpus.models import TpuVm

    emulator, admin, vm = scene
    emulator.controls.set_oslogin(PROJECT, True)
    with django_capture_on_commit_callbacks(execute=True):
        connect.connect_vm(admin, vm)
    [((connection_id, attempt, check), _)] = queued_tasks.take(CHECK)
    # Another VM of the lab is trying its workers (which may hang until the timeout).
    other = TpuVm.objects.create(lab=vm.lab, name="tpu6", zone=ZONE, source="imported")
    busy = VmConnection.objects.create(
        vm=other, state=ConnectionState.CONNECTING, attempt=1,
        looking_until=timezone.now() + dt.timedelta(seconds=30),
    )  # fmt: skip

    started = time.monotonic()
    with django_capture_on_commit_callbacks(execute=True):
        connect.check_connection(connection_id, attempt, check)

    # Its turn comes later: it asks again in a second, holding no Celery worker.
    assert time.monotonic() - started < 0.5
    assert queued_tasks.take(CHECK) == [
        ((connection_id, attempt, check), connect.TURN_WAIT_SECONDS)
    ]
    connection = VmConnection.objects.get(pk=connection_id)
    assert connection.checks == 0 and connection.looking_until is None
    assert {w["state"] for w in connection.workers.values()} == {"waiting"}
    assert connect.stalled_connections() == []
    # The other's try is over: this one tries its workers now.
    VmConnection.objects.filter(pk=busy.pk).update(looking_until=None)
    with django_capture_on_commit_callbacks(execute=True):
        connect.check_connection(connection_id, attempt, check)
    connection.refresh_from_db()
    assert connection.checks == 1 and connection.looking_until is None
    assert {w["state"] for w in connection.workers.values()} == {"refused"}


def test_a_connection_whose_check_was_lost_is_checked_again(make_lab, settings):
    import datetime as dt

    from django.utils import timezone

    from tpus.models import ConnectionState, TpuVm, VmConnection
    from tpus.services import connect

    settings.PORTAL_CONNECT_WAIT_SECONDS = 10
    lab = make_lab()
    now = timezone.now()

    def connecting(name: str, **fields) -> VmConnection:
        vm = TpuVm.objects.create(lab=lab, name=name, zone="us-central1-f", source="imported")
        return VmConnection.objects.create(vm=vm, state=ConnectionState.CONNECTING, **fields)

    lost = connecting("tpu8", attempt=3, checks=7, next_check_at=now - dt.timedelta(seconds=61))
    connecting("tpu9", attempt=1, checks=2, next_check_at=now - dt.timedelta(seconds=5))
    # Left by an earlier version, which kept no due time: counted from its start.
    earlier = connecting("tpu10", attempt=2, started_at=now - dt.timedelta(seconds=71))
    connecting("tpu11", attempt=1, started_at=now)

    assert connect.stalled_connections() == [(lost.pk, 3, 7), (earlier.pk, 2, 0)]


def test_disconnect_closes_the_connections_kept_to_the_vms_workers_and_never_reuses_them(
    scene, django_capture_on_commit_callbacks
):
    from tpus.remote.kept import kept
    from tpus.services.hosts import remote_worker

    emulator, admin, vm = scene
    _connect(admin, vm, django_capture_on_commit_callbacks)  # and the reconcile after it
    login = login_for(vm.lab)
    before = [remote_worker(w, login) for w in vm.workers.order_by("index")]
    for worker in before:
        run_script(worker, "whoami.sh")
    assert sorted(k.address for k in kept.idle()) == sorted(w.address for w in before)

    connect.disconnect_vm(admin, vm)

    assert kept.idle() == []
    after = [remote_worker(w, login) for w in vm.workers.order_by("index")]
    assert [w.generation for w in after] == [w.generation + 1 for w in before]

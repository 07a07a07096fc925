"""The API's view of one VM's workers: per-worker provisioning progress, and host key
review and pinning bound to the worker and address, as the pages do. Scans, pins and
reconciles go to the real sshd fleet."""

from __future__ import annotations

import subprocess

import pytest

from accounts.keys import add_key
from accounts.models import User
from accounts.services import create_token
from accounts.tests.keydata import ED25519
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tpus.models import Grant, HostKeyScan, TpuVm, Worker
from tpus.services import inventory
from tpus.services.grants import grant_access

ZONE = "us-central1-f"


@pytest.fixture
def token_for(db):
    def make(user):
        return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}

    return make


def _vm(lab, name="tpu5", workers=1, pinned=True) -> TpuVm:
    vm = TpuVm.objects.create(lab=lab, name=name, zone=ZONE, source="manual")
    for index in range(workers):
        Worker.objects.create(
            vm=vm,
            index=index,
            external_ip=f"192.0.2.{10 + index}",
            host_keys=[ED25519] if pinned else [],
        )
    return vm


# --- Cross-lab: another lab's VM or worker is a 404, whichever lab the URL names ---


@pytest.mark.parametrize(
    "method, suffix, body",
    [
        ("get", "progress", None),
        ("get", "workers/0/host-keys", None),
        ("post", "workers/0/host-keys/scan", {}),
        ("post", "workers/0/host-keys/pin", {"shown": "forged"}),
    ],
)
def test_another_labs_vm_is_a_404_for_every_worker_endpoint(
    client, cast, token_for, method, suffix, body
):
    theirs = _vm(cast.other_lab, pinned=False)
    auth = token_for(cast.admin)
    for slug in (cast.lab.slug, cast.other_lab.slug):
        url = f"/api/v1/labs/{slug}/vms/{theirs.pk}/{suffix}"
        if method == "post":
            response = client.post(url, body, content_type="application/json", **auth)
        else:
            response = client.get(url, **auth)
        assert response.status_code == 404, (url, response.content)
        assert "detail" in response.json()
    assert not HostKeyScan.objects.exists()
    assert theirs.workers.get().host_keys == []


def test_a_worker_index_the_vm_does_not_have_is_a_404(client, cast, token_for):
    vm = _vm(cast.lab)
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/workers/3/host-keys"
    assert client.get(url, **token_for(cast.admin)).status_code == 404


def test_a_member_who_is_not_an_admin_is_refused_with_the_reason(client, cast, token_for):
    vm = _vm(cast.lab)
    response = client.get(
        f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/progress", **token_for(cast.member)
    )
    assert response.status_code == 403
    assert "admins" in response.json()["detail"]


# --- Progress, without hosts: what each worker is waiting for ---


def test_progress_lists_each_workers_pending_grants_and_what_holds_it_up(
    client, cast, token_for, django_capture_on_commit_callbacks
):
    vm = _vm(cast.lab, workers=2)
    choose_username(cast.member, "milo")
    member = User.objects.get(pk=cast.member.pk)
    with django_capture_on_commit_callbacks():  # the reconcile is queued, not run
        [grant] = grant_access(cast.admin, cast.lab, member, [vm], sudo=False)
    # Meanwhile worker 1 lost its pins (as when the VM is registered again).
    Worker.objects.filter(vm=vm, index=1).update(host_keys=[])
    response = client.get(
        f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/progress", **token_for(cast.admin)
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["in_flight"] is True and body["running"] is False
    first, second = body["workers"]
    assert first["alias"] == "tpu5-w0" and first["state"] == "queued"
    assert first["host_keys"] == "pinned" and first["applied_version"] is None
    assert second["state"] == "host_keys_unconfirmed" and second["host_keys"] == "unpinned"
    for worker in (first, second):
        assert worker["desired_version"] == grant.version
        assert worker["pending_grants"] == [
            {
                "grant_id": grant.pk,
                "user": member.email,
                "username": "milo",
                "grant_state": "pending",
                "state": "waiting",
                "error": "",
            }
        ]


def test_progress_costs_the_same_queries_for_many_grants(
    client, cast, token_for, make_user, add_member, django_assert_max_num_queries
):
    vm = _vm(cast.lab, workers=4)
    for n in range(12):
        person = make_user(f"p{n}@vision.example")
        add_member(cast.lab, person)
        Grant.objects.create(user=person, vm=vm, state="pending", version=1)
    auth = token_for(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/progress"
    with django_assert_max_num_queries(12):
        body = client.get(url, **auth).json()
    assert all(len(w["pending_grants"]) == 12 for w in body["workers"])


# --- On the fleet: real scans, real pins, a real reconcile ---


def _token(user) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}


def _fingerprints_by_ssh_keygen(lines: list[str], tmp_path) -> set[str]:
    path = tmp_path / "keys.pub"
    path.write_text("".join(f"{line}\n" for line in lines))
    out = subprocess.run(
        ["ssh-keygen", "-lf", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[1] for line in out.splitlines()}


@pytest.fixture
def manual_vm(cast, fleet, fleet_hosts, fleet_settings):
    """A VM of two fleet hosts registered by hand: no keys pinned yet."""
    hosts = fleet_hosts(2)
    vm = inventory.register_manual_vm(
        cast.site_admin, cast.lab, name="tpu9", zone=ZONE, accelerator_type="v3-8",
        workers=[inventory.ManualWorker(internal_ip=None, external_ip=h.ip) for h in hosts],
    )  # fmt: skip
    vm.hosts = hosts
    return vm


@pytest.mark.fleet
def test_an_admin_scans_reviews_and_pins_a_workers_keys_through_the_api(
    client, cast, fleet, manual_vm, tmp_path, django_capture_on_commit_callbacks
):
    auth = _token(cast.admin)
    base = f"/api/v1/labs/{cast.lab.slug}/vms/{manual_vm.pk}/workers/0/host-keys"
    before = client.get(base, **auth).json()
    assert before["state"] == "unpinned" and before["scan"] is None and before["pinned"] == []

    with django_capture_on_commit_callbacks() as queued:
        response = client.post(f"{base}/scan", **auth)
    assert response.status_code == 202, response.content
    assert response.json()["scan"]["state"] == "queued"
    assert response.json()["scan"]["shown"] is None  # nothing to confirm yet
    for task in queued:
        task()  # the worker runs the scan

    scan = client.get(base, **auth).json()["scan"]
    host = manual_vm.hosts[0]
    offered = fleet.host_keys(host.name)
    assert scan["state"] == "done" and scan["address"] == host.ip
    assert {k["key"] for k in scan["keys"]} == set(offered)
    # The fingerprints are the ones ssh-keygen prints for the host's own key files.
    assert {k["fingerprint"] for k in scan["keys"]} == _fingerprints_by_ssh_keygen(
        offered, tmp_path
    )

    pinned = client.post(
        f"{base}/pin", {"shown": scan["shown"]}, content_type="application/json", **auth
    )
    assert pinned.status_code == 200, pinned.content
    assert pinned.json()["state"] == "pinned" and pinned.json()["pinned_source"] == "admin"
    assert sorted(manual_vm.workers.get(index=0).host_keys) == sorted(offered)
    assert manual_vm.workers.get(index=1).host_keys == []


def _scanned(client, auth, base, capture) -> dict:
    with capture(execute=True):
        assert client.post(f"{base}/scan", **auth).status_code == 202
    return client.get(base, **auth).json()["scan"]


@pytest.mark.fleet
def test_keys_shown_for_one_worker_cannot_be_pinned_on_another(
    client, cast, manual_vm, django_capture_on_commit_callbacks
):
    auth = _token(cast.admin)
    base = f"/api/v1/labs/{cast.lab.slug}/vms/{manual_vm.pk}/workers"
    shown = _scanned(client, auth, f"{base}/0/host-keys", django_capture_on_commit_callbacks)
    response = client.post(
        f"{base}/1/host-keys/pin",
        {"shown": shown["shown"]},
        content_type="application/json",
        **auth,
    )
    assert response.status_code == 400
    assert "another worker, not tpu9-w1" in response.json()["detail"]
    assert not Worker.objects.filter(vm=manual_vm).exclude(host_keys=[]).exists()


@pytest.mark.fleet
def test_keys_read_at_an_address_the_worker_has_left_cannot_be_pinned(
    client, cast, manual_vm, django_capture_on_commit_callbacks
):
    auth = _token(cast.admin)
    base = f"/api/v1/labs/{cast.lab.slug}/vms/{manual_vm.pk}/workers/0/host-keys"
    shown = _scanned(client, auth, base, django_capture_on_commit_callbacks)["shown"]
    manual_vm.workers.filter(index=0).update(external_ip="10.213.99.99")
    response = client.post(f"{base}/pin", {"shown": shown}, content_type="application/json", **auth)
    assert response.status_code == 400
    assert "is now at 10.213.99.99" in response.json()["detail"]
    # And the scan of the old address is no longer offered.
    assert client.get(base, **auth).json()["scan"] is None
    assert manual_vm.workers.get(index=0).host_keys == []


@pytest.mark.fleet
def test_keys_that_were_never_shown_are_refused(client, cast, manual_vm):
    auth = _token(cast.admin)
    base = f"/api/v1/labs/{cast.lab.slug}/vms/{manual_vm.pk}/workers/0/host-keys"
    response = client.post(
        f"{base}/pin", {"shown": ED25519}, content_type="application/json", **auth
    )
    assert response.status_code == 400
    assert "not the ones shown" in response.json()["detail"]
    assert manual_vm.workers.get(index=0).host_keys == []


@pytest.mark.fleet
def test_progress_follows_a_real_grant_until_every_worker_has_it(
    client, cast, tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids,
    tmp_path, django_capture_on_commit_callbacks,
):  # fmt: skip
    hosts = fleet_hosts(2)
    cast.lab.gcp_project_id = "vision-lab-1"
    cast.lab.zones = [ZONE]
    cast.lab.save()
    add_fleet_node(tpu_emulator.controls, fleet, hosts, "vision-lab-1", ZONE, "tpu5")
    give_lab_key(fleet, hosts, cast.lab)
    [vm] = inventory.import_vms(cast.admin, cast.lab, [f"{ZONE}/tpu5"])
    choose_username(cast.member, fleet_username)
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    add_key(cast.member, key.with_suffix(".pub").read_text().strip())
    member = User.objects.get(pk=cast.member.pk)
    auth = _token(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/progress"

    with django_capture_on_commit_callbacks() as queued:
        [grant] = grant_access(cast.admin, cast.lab, member, [vm], sudo=False)
    waiting = client.get(url, **auth).json()
    assert waiting["in_flight"] is True
    assert [w["state"] for w in waiting["workers"]] == ["queued", "queued"]
    assert [[g["grant_id"] for g in w["pending_grants"]] for w in waiting["workers"]] == [
        [grant.pk],
        [grant.pk],
    ]

    with django_capture_on_commit_callbacks(execute=True):
        for task in queued:
            task()  # the reconcile, on both hosts
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    done = client.get(url, **auth).json()
    assert done["in_flight"] is False and done["running"] is False
    for worker, host in zip(done["workers"], hosts, strict=True):
        assert worker["state"] == "up_to_date" and worker["external_ip"] == host.ip
        assert worker["applied_version"] == done["desired_version"] >= grant.version
        assert worker["pending_grants"] == [] and worker["last_error"] == ""
        assert worker["host_keys"] == "pinned"

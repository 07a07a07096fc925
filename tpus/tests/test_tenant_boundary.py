"""One lab can never aim the portal at another lab's TPU VMs: not by taking its GCP
project, not by typing its workers' addresses, not by pinning its host keys. Each
attack is made by lab A's admin against lab B, over the pages and the API, and each
is refused and changes nothing."""

from __future__ import annotations

import pytest
from django.core import signing
from django.db import IntegrityError, transaction
from django.urls import reverse

from tpus.emulator.controls import new_host_key
from tpus.models import Lab, TpuVm, Worker
from tpus.services import inventory
from tpus.services import labs as lab_services
from tpus.services.hostkey_scans import SALT

ZONE = "us-central1-f"
B_ADDRESS, B_INTERNAL = "34.9.9.9", "10.9.0.2"


def _key() -> str:
    return f"ssh-ed25519 {new_host_key()}"


@pytest.fixture
def labs(make_lab, make_user, add_member):
    """Lab A and lab B (discoverable, so A's admin can find it), each with its own
    admin; lab B has a worker with a pinned host key."""
    a = make_lab("Lab A", slug="lab-a", gcp_project_id="lab-a-project", zones=[ZONE])
    b = make_lab(
        "Lab B", slug="lab-b", gcp_project_id="lab-b-project", zones=[ZONE], discoverable=True
    )
    a_admin, b_admin = make_user("boss@a.example"), make_user("boss@b.example")
    add_member(a, a_admin, role="admin")
    add_member(b, b_admin, role="admin")
    b_vm = TpuVm.objects.create(lab=b, name="tpu5", zone=ZONE, source="imported")
    b_worker = Worker.objects.create(
        vm=b_vm, index=0, external_ip=B_ADDRESS, internal_ip=B_INTERNAL, host_keys=[_key()]
    )
    return a, b, a_admin, b_admin, b_worker


@pytest.fixture
def site_admin(make_user):
    return make_user("root@portal.example", is_superuser=True, is_staff=True)


def _lab_row(lab: Lab) -> tuple:
    lab.refresh_from_db()
    return (lab.name, lab.gcp_project_id, lab.zones, lab.policy_version)


def _settings_form(lab: Lab, **changes) -> dict:
    return {"name": lab.name, "policy_text": lab.policy_text, **changes}


# --- Critical 1: a lab's GCP project ------------------------------------------------


def test_a_lab_admin_cannot_point_their_lab_at_another_labs_project(client, labs):
    a, b, a_admin, *_ = labs
    before = _lab_row(a)
    client.force_login(a_admin)
    response = client.post(
        reverse("lab_settings", args=[a.slug]),
        _settings_form(a, name="Renamed", gcp_project_id=b.gcp_project_id),
    )
    assert response.status_code == 403
    assert _lab_row(a) == before


def test_a_lab_admin_cannot_change_their_labs_zones(client, labs):
    a, _, a_admin, *_ = labs
    before = _lab_row(a)
    client.force_login(a_admin)
    response = client.post(
        reverse("lab_settings", args=[a.slug]), _settings_form(a, zones="europe-west4-a")
    )
    assert response.status_code == 403
    assert _lab_row(a) == before


def test_a_lab_admin_cannot_reach_another_labs_settings(client, labs):
    a, b, a_admin, *_ = labs
    before = _lab_row(b)
    client.force_login(a_admin)
    response = client.post(
        reverse("lab_settings", args=[b.slug]),
        _settings_form(b, gcp_project_id="attacker-project"),
    )
    assert response.status_code == 404
    assert _lab_row(b) == before


def test_a_lab_admins_settings_form_has_no_project_or_zones(client, labs):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    body = client.get(reverse("lab_settings", args=[a.slug])).content.decode()
    assert 'name="gcp_project_id"' not in body
    assert 'name="zones"' not in body
    assert "only a site admin sets the project" in body


def test_a_lab_admin_still_saves_the_rest_of_their_labs_settings(client, labs):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    response = client.post(reverse("lab_settings", args=[a.slug]), _settings_form(a, name="A2"))
    assert response.status_code == 302
    assert _lab_row(a)[:3] == ("A2", "lab-a-project", [ZONE])


def test_the_service_refuses_a_project_change_from_a_lab_admin(labs):
    a, b, a_admin, *_ = labs
    before = _lab_row(a)
    for changes in ({"gcp_project_id": "lab-c-project"}, {"zones": ["europe-west4-a"]}):
        with pytest.raises(lab_services.LabError, match="Only a site admin"):
            lab_services.update_lab(a_admin, a, changes)
    assert _lab_row(a) == before


def test_a_site_admin_moves_a_lab_to_a_new_project_and_zones(client, labs, site_admin):
    a, *_ = labs
    client.force_login(site_admin)
    body = client.get(reverse("lab_settings", args=[a.slug])).content.decode()
    assert 'name="gcp_project_id"' in body
    response = client.post(
        reverse("lab_settings", args=[a.slug]),
        _settings_form(a, gcp_project_id="lab-a-new-project", zones="europe-west4-a"),
    )
    assert response.status_code == 302
    assert _lab_row(a)[1:3] == ("lab-a-new-project", ["europe-west4-a"])


def test_a_project_that_belongs_to_another_lab_is_refused_without_naming_it(
    client, labs, site_admin
):
    a, b, *_ = labs
    before = _lab_row(a)
    client.force_login(site_admin)
    response = client.post(
        reverse("lab_settings", args=[a.slug]),
        _settings_form(a, gcp_project_id=b.gcp_project_id, zones=ZONE),
    )
    body = response.content.decode()
    assert "This GCP project already belongs to another lab" in body
    assert b.name not in body and f"/labs/{b.slug}/" not in body
    assert _lab_row(a) == before


def test_a_new_lab_cannot_take_a_project_another_lab_has(client, labs, site_admin):
    _, b, *_ = labs
    client.force_login(site_admin)
    response = client.post(
        reverse("lab_create"),
        {
            "name": "Lab C",
            "slug": "lab-c",
            "gcp_project_id": b.gcp_project_id,
            "policy_text": "Research only.",
            "admin_emails": "boss@a.example",
        },
    )
    assert "already belongs to another lab" in response.content.decode()
    assert not Lab.objects.filter(slug="lab-c").exists()


def test_the_database_refuses_two_labs_with_one_project(labs):
    _, b, *_ = labs
    with pytest.raises(IntegrityError), transaction.atomic():
        Lab.objects.create(name="Copy", slug="copy", gcp_project_id=b.gcp_project_id)


def test_the_api_hides_another_labs_project_from_a_lab_admin(client, labs):
    a, b, a_admin, *_ = labs
    client.force_login(a_admin)
    listed = {lab["slug"]: lab for lab in client.get("/api/v1/labs").json()["items"]}
    assert (listed["lab-b"]["gcp_project_id"], listed["lab-b"]["zones"]) == (None, None)
    assert (listed["lab-a"]["gcp_project_id"], listed["lab-a"]["zones"]) == (
        "lab-a-project",
        [ZONE],
    )
    one = client.get(f"/api/v1/labs/{b.slug}").json()
    assert (one["gcp_project_id"], one["zones"]) == (None, None)
    assert b.gcp_project_id not in client.get("/api/v1/labs").content.decode()


def test_someone_who_only_asked_to_join_does_not_see_the_project(client, labs, make_user):
    _, b, *_ = labs
    applicant = make_user()
    lab_services.request_membership(applicant, b, purpose="Research.", accept_policy=True)
    client.force_login(applicant)
    one = client.get(f"/api/v1/labs/{b.slug}").json()
    assert one["my_state"] == "requested"
    assert one["gcp_project_id"] is None
    for page in (reverse("lab_list"), reverse("lab_detail", args=[b.slug])):
        assert b.gcp_project_id not in client.get(page).content.decode()


def test_the_labs_own_members_and_site_admins_see_the_project(
    client, labs, make_user, add_member, site_admin
):
    _, b, *_ = labs
    member = make_user()
    add_member(b, member)
    for user in (member, site_admin):
        client.force_login(user)
        one = client.get(f"/api/v1/labs/{b.slug}").json()
        assert (one["gcp_project_id"], one["zones"]) == ("lab-b-project", [ZONE])
        assert b.gcp_project_id in client.get(reverse("lab_detail", args=[b.slug])).content.decode()


def test_the_pages_hide_another_labs_project_from_a_lab_admin(client, labs):
    _, b, a_admin, *_ = labs
    client.force_login(a_admin)
    for page in (reverse("lab_list"), reverse("lab_detail", args=[b.slug])):
        response = client.get(page)
        assert response.status_code == 200
        assert b.gcp_project_id not in response.content.decode()


@pytest.mark.parametrize("method", ["put", "patch"])
def test_the_api_has_no_way_to_change_a_labs_project(client, labs, method):
    a, b, a_admin, *_ = labs
    before = _lab_row(a)
    client.force_login(a_admin)
    response = getattr(client, method)(
        f"/api/v1/labs/{a.slug}",
        {"gcp_project_id": b.gcp_project_id},
        content_type="application/json",
    )
    assert response.status_code == 405
    assert _lab_row(a) == before


# --- Critical 2: registering a VM by hand ----------------------------------------------


def _register(client, lab, workers: str):
    return client.post(
        reverse("vm_register", args=[lab.slug]),
        {"name": "tpu9", "zone": ZONE, "accelerator_type": "v3-8", "workers": workers},
    )


def test_a_lab_admin_cannot_register_a_vm_by_hand_in_their_own_lab(client, labs):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    assert client.get(reverse("vm_register", args=[a.slug])).status_code == 403
    response = _register(client, a, B_ADDRESS)
    assert response.status_code == 403
    assert not TpuVm.objects.filter(lab=a).exists()


def test_a_lab_admin_gets_a_404_for_another_labs_register_page(client, labs):
    _, b, a_admin, *_ = labs
    client.force_login(a_admin)
    assert _register(client, b, "34.1.2.3").status_code == 404
    assert TpuVm.objects.filter(lab=b).count() == 1


def test_the_lab_admins_vm_list_offers_no_registration_by_hand(client, labs):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    body = client.get(reverse("vm_list", args=[a.slug])).content.decode()
    assert reverse("vm_register", args=[a.slug]) not in body


def test_the_api_has_no_way_to_register_a_vm_by_hand(client, labs):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    response = client.post(
        f"/api/v1/labs/{a.slug}/vms",
        {"name": "tpu9", "zone": ZONE, "workers": [{"external_ip": B_ADDRESS}]},
        content_type="application/json",
    )
    assert response.status_code == 405
    assert not TpuVm.objects.filter(lab=a).exists()


def test_the_service_refuses_registration_by_a_lab_admin(labs):
    a, _, a_admin, *_ = labs
    with pytest.raises(inventory.InventoryError, match="Only a site admin"):
        inventory.register_manual_vm(
            a_admin, a, name="tpu9", zone=ZONE, accelerator_type="v3-8",
            workers=[inventory.ManualWorker(internal_ip=None, external_ip="34.1.2.3")],
        )  # fmt: skip
    assert not TpuVm.objects.filter(lab=a).exists()


@pytest.mark.parametrize(
    "workers, taken",
    [
        (B_ADDRESS, B_ADDRESS),
        (f"34.1.2.3 {B_INTERNAL}", B_INTERNAL),
        (f"34.1.2.3\n{B_INTERNAL}", B_INTERNAL),
    ],
    ids=["external as external", "internal as internal", "internal as external"],
)
def test_an_address_of_another_labs_worker_is_refused_at_registration(
    client, labs, site_admin, workers, taken
):
    a, *_ = labs
    client.force_login(site_admin)
    response = _register(client, a, workers)
    assert response.status_code == 200
    assert f"{taken} already belongs to a worker of another lab" in response.content.decode()
    assert not TpuVm.objects.filter(lab=a).exists()
    assert Worker.objects.count() == 1


def test_a_site_admin_registers_an_address_no_other_lab_has(client, labs, site_admin):
    a, *_ = labs
    client.force_login(site_admin)
    assert _register(client, a, "34.1.2.3 10.0.0.2").status_code == 302
    assert TpuVm.objects.get(lab=a).workers.get().external_ip == "34.1.2.3"


# --- Pinning another lab's host key ----------------------------------------------------


@pytest.fixture
def a_worker(labs):
    """A worker of lab A, unpinned, at an address of its own."""
    a = labs[0]
    vm = TpuVm.objects.create(lab=a, name="tpu1", zone=ZONE, source="manual")
    return Worker.objects.create(vm=vm, index=0, external_ip="34.1.2.3")


def _shown(worker, keys, *, worker_id=None, address=None) -> str:
    payload = {
        "worker": worker.pk if worker_id is None else worker_id,
        "address": worker.external_ip if address is None else address,
        "keys": keys,
    }
    return signing.dumps(payload, salt=SALT)


def _pin(client, worker, shown):
    url = reverse("worker_keys", args=[worker.vm.lab.slug, worker.vm_id, worker.index])
    return client.post(url, {"shown": shown}, follow=True)


def test_a_lab_admin_cannot_pin_another_labs_workers_host_key(client, labs, a_worker):
    *_, a_admin, _, b_worker = labs
    client.force_login(a_admin)
    response = _pin(client, a_worker, _shown(a_worker, b_worker.host_keys))
    assert "already pinned for a worker of another lab" in response.content.decode()
    a_worker.refresh_from_db()
    assert a_worker.host_keys == []


def test_a_lab_admin_cannot_replace_their_pin_with_another_labs_host_key(client, labs, a_worker):
    *_, a_admin, _, b_worker = labs
    own = [_key()]
    Worker.objects.filter(pk=a_worker.pk).update(host_keys=own)
    client.force_login(a_admin)
    response = _pin(client, a_worker, _shown(a_worker, [_key(), *b_worker.host_keys]))
    assert "already pinned for a worker of another lab" in response.content.decode()
    a_worker.refresh_from_db()
    assert a_worker.host_keys == own


def test_a_lab_admin_cannot_pin_keys_on_another_labs_worker(client, labs):
    *_, a_admin, _, b_worker = labs
    before = list(b_worker.host_keys)
    client.force_login(a_admin)
    url = reverse("worker_keys", args=["lab-b", b_worker.vm_id, 0])
    assert client.post(url, {"shown": _shown(b_worker, [_key()])}).status_code == 404
    b_worker.refresh_from_db()
    assert b_worker.host_keys == before


def test_the_services_refuse_another_labs_host_key_by_every_route(labs, a_worker):
    *_, a_admin, _, b_worker = labs
    for pin in (inventory.pin_host_keys, inventory.repin_host_keys):
        with pytest.raises(inventory.InventoryError, match="another lab"):
            pin(a_admin, a_worker, b_worker.host_keys)
    a_worker.refresh_from_db()
    assert a_worker.host_keys == []


def test_the_same_lab_may_pin_a_key_it_already_has(labs, a_worker):
    """Re-pinning a key of the lab's own worker is not a conflict."""
    a, _, a_admin, *_ = labs
    key = [_key()]
    inventory.pin_host_keys(a_admin, a_worker, key)
    inventory.repin_host_keys(a_admin, a_worker, key)
    a_worker.refresh_from_db()
    assert a_worker.host_keys == key


def test_keys_scanned_from_another_worker_are_not_pinned(client, labs, a_worker):
    a, _, a_admin, *_ = labs
    other = Worker.objects.create(vm=a_worker.vm, index=1, external_ip="34.1.2.4")
    client.force_login(a_admin)
    response = _pin(client, a_worker, _shown(other, [_key()]))
    assert "read from another worker" in response.content.decode()
    a_worker.refresh_from_db()
    assert a_worker.host_keys == []


def test_keys_scanned_at_an_address_the_worker_no_longer_has_are_not_pinned(client, labs, a_worker):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    shown = _shown(a_worker, [_key()], address=B_ADDRESS)
    response = _pin(client, a_worker, shown)
    assert f"read from {B_ADDRESS}, but tpu1-w0 is now at 34.1.2.3" in response.content.decode()
    a_worker.refresh_from_db()
    assert a_worker.host_keys == []


def test_a_confirmation_in_the_old_keys_only_form_is_not_pinned(client, labs, a_worker):
    a, _, a_admin, *_ = labs
    client.force_login(a_admin)
    response = _pin(client, a_worker, signing.dumps([_key()], salt=SALT))
    assert "not the ones shown" in response.content.decode()
    a_worker.refresh_from_db()
    assert a_worker.host_keys == []


def test_an_import_does_not_pin_a_published_host_key_another_lab_has(client, labs, tpu_emulator):
    a, _, a_admin, _, b_worker = labs
    stolen = b_worker.host_keys[0].split()[1]
    tpu_emulator.controls.add_node(
        a.gcp_project_id, ZONE, "tpu7", workers=2,
        host_keys={0: {"ssh-ed25519": stolen}, 1: {"ssh-ed25519": new_host_key()}},
    )  # fmt: skip
    client.force_login(a_admin)
    response = client.post(
        reverse("vm_import", args=[a.slug]), {"nodes": [f"{ZONE}/tpu7"]}, follow=True
    )
    assert "tpu7-w0 offers a host key that is already pinned" in response.content.decode()
    workers = list(TpuVm.objects.get(lab=a, name="tpu7").workers.order_by("index"))
    assert workers[0].host_keys == []
    assert workers[1].host_keys and workers[1].host_keys_source == "guest_attributes"


def test_an_import_through_the_api_does_not_pin_a_host_key_another_lab_has(
    client, labs, tpu_emulator
):
    a, _, a_admin, _, b_worker = labs
    stolen = b_worker.host_keys[0].split()[1]
    tpu_emulator.controls.add_node(
        a.gcp_project_id, ZONE, "tpu7", workers=1, host_keys={0: {"ssh-ed25519": stolen}}
    )
    client.force_login(a_admin)
    response = client.post(
        f"/api/v1/labs/{a.slug}/import",
        {"nodes": [f"{ZONE}/tpu7"]},
        content_type="application/json",
    )
    assert response.status_code == 201
    assert response.json()[0]["workers"][0]["host_keys"] == []
    assert TpuVm.objects.get(lab=a, name="tpu7").workers.get().host_keys == []

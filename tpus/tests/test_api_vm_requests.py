"""TPU VMs the portal makes, through the token API: ask, follow, cancel; the lab's
allowance; stop, start and delete with the name given to confirm."""

from __future__ import annotations

import pytest
from django.test import Client

from accounts.services import create_token
from tpus.models import LabAllowance, TpuVm, VmRequest
from tpus.services import vm_lifecycle, vm_request_work, vm_requests

PROJECT = "vision-project"
ZONE = "us-central2-b"


@pytest.fixture
def lab(cast, tpu_emulator):
    cast.lab.gcp_project_id, cast.lab.zones = PROJECT, [ZONE]
    cast.lab.save()
    return cast.lab


def api(user) -> Client:
    _, raw = create_token(user, "script")
    return Client(HTTP_AUTHORIZATION=f"Bearer {raw}")


BODY = {
    "name": "tpu5",
    "zone": ZONE,
    "accelerator_type": "v4-32",
    "runtime_version": "tpu-ubuntu2204-base",
    "provisioning": "spot",
    "queued": True,
}


def test_a_site_admin_sets_the_allowance_and_an_admin_asks_follows_and_cancels(
    cast, lab, tpu_emulator
):
    root, admin = api(cast.site_admin), api(cast.admin)
    url = f"/api/v1/labs/{lab.slug}"
    refused = admin.post(f"{url}/vm-requests", BODY, content_type="application/json")
    assert refused.status_code == 400
    assert "no allowance for spot v4 chips" in refused.json()["fields"]["accelerator_type"][0]
    assert admin.put(
        f"{url}/allowances", {"generation": "v4", "provisioning": "spot", "chips": 16},
        content_type="application/json",
    ).status_code == 403  # fmt: skip
    answer = root.put(
        f"{url}/allowances",
        {"generation": "v4", "provisioning": "spot", "chips": 16},
        content_type="application/json",
    )
    assert answer.json() == [
        {"generation": "v4", "provisioning": "spot", "chips": 16, "used": 0, "left": 16}
    ]

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = admin.post(f"{url}/vm-requests", BODY, content_type="application/json")
    assert made.status_code == 201
    body = made.json()
    assert (body["state"], body["provisioning"], body["queued"]) == ("requested", "spot", True)
    vm_request_work.send(body["id"])
    one = admin.get(f"{url}/vm-requests/{body['id']}").json()
    assert one["state"] == "waiting" and one["waiting_since"]
    assert admin.get(f"{url}/allowances").json()[0]["used"] == 16
    assert [r["id"] for r in admin.get(f"{url}/vm-requests").json()["items"]] == [body["id"]]
    cancelled = admin.post(f"{url}/vm-requests/{body['id']}/cancel")
    assert cancelled.json()["state"] == "cancelled"
    assert tpu_emulator.controls.queued_resources() == {}


def test_stop_start_and_delete_through_the_api(cast, lab, tpu_emulator):
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="on-demand", chips=4)
    made = vm_requests.request_vm(
        cast.admin, lab, vm_requests.VmSpec(name="tpu5", zone=ZONE, accelerator_type="v4-8",
                                            runtime_version="tpu-ubuntu2204-base"),
    )  # fmt: skip
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    admin, url = api(cast.admin), f"/api/v1/labs/{lab.slug}/vms/{vm.pk}"
    assert admin.post(f"{url}/start").json()["detail"].endswith("only a stopped VM starts.")
    assert admin.post(f"{url}/stop").json() == {"id": vm.pk, "name": "tpu5", "state": "STOPPING"}
    vm_lifecycle.run(vm.pk, "stop")
    assert admin.post(f"{url}/start").status_code == 202
    vm_lifecycle.run(vm.pk, "start")
    wrong = admin.post(f"{url}/delete", {"name": "tpu"}, content_type="application/json")
    assert wrong.status_code == 400 and "Type the VM's name, tpu5" in wrong.json()["detail"]
    assert admin.post(
        f"{url}/delete", {"name": "tpu5"}, content_type="application/json"
    ).status_code == 202  # fmt: skip
    vm_lifecycle.run(vm.pk, "delete")
    assert tpu_emulator.client.list_nodes(PROJECT, ZONE) == []
    assert not VmRequest.objects.filter(keep_alive=True).exists()


def test_a_failed_request_is_tried_again_through_the_api(cast, lab, tpu_emulator):
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=16)
    admin = api(cast.admin)
    url = f"/api/v1/labs/{lab.slug}/vm-requests"
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = admin.post(url, BODY, content_type="application/json").json()
    refused = admin.post(f"{url}/{made['id']}/retry")
    assert refused.status_code == 400 and "failed or cancelled" in refused.json()["detail"]
    VmRequest.objects.filter(pk=made["id"]).update(state="cancelled")
    again = admin.post(f"{url}/{made['id']}/retry")
    assert again.status_code == 201
    assert again.json()["id"] != made["id"] and again.json()["name"] == "tpu5"
    assert api(cast.member).post(f"{url}/{made['id']}/retry").status_code == 403

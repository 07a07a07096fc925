"""The lab admin's "Create a TPU VM" page: what the lab may hold and holds, the form
(offered types and versions from the API), refusals on their fields with nothing
stored, the requests with their states, cancel; and the site admin's allowance form."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tpus.models import AuditEvent, LabAllowance, VmRequest

PROJECT = "vision-project"
ZONE = "us-central2-b"


@pytest.fixture
def lab(cast, tpu_emulator):
    cast.lab.gcp_project_id = PROJECT
    cast.lab.zones = [ZONE]
    cast.lab.save()
    LabAllowance.objects.create(lab=cast.lab, generation="v4", provisioning="spot", chips=32)
    return cast.lab


def form(**fields) -> dict:
    values = {
        "name": "tpu5",
        "zone": ZONE,
        "accelerator_type": "v4-32",
        "runtime_version": "tpu-ubuntu2204-base",
        "provisioning": "spot",
        "queued": "on",
        "keep_alive": "on",
    }
    values.update(fields)
    return values


def test_the_page_shows_the_allowance_and_what_the_zone_offers(client, cast, lab):
    client.force_login(cast.admin)
    page = client.get(reverse("vm_create", args=[lab.slug]))
    text = page.content.decode()
    assert page.status_code == 200
    assert "<td>v4</td><td>spot</td><td>0</td><td>32</td><td>32</td>" in text
    assert '<option value="v4-32">' in text
    assert '<option value="tpu-ubuntu2204-base">' in text
    assert "The lab has asked for no TPU VM yet." in text


def test_a_request_is_stored_audited_and_listed(client, cast, lab, tpu_emulator):
    client.force_login(cast.admin)
    answer = client.post(reverse("vm_create", args=[lab.slug]), form())
    assert answer.status_code == 302
    made = VmRequest.objects.get()
    assert (made.name, made.provisioning, made.queued, made.keep_alive) == (
        "tpu5", "spot", True, True
    )  # fmt: skip
    assert AuditEvent.objects.filter(action="vm.requested", actor=cast.admin).exists()
    text = client.get(reverse("vm_create", args=[lab.slug])).content.decode()
    assert "Spot, queued, kept alive" in text and "Requested" in text
    assert "<td>v4</td><td>spot</td><td>16</td><td>32</td><td>16</td>" in text


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"accelerator_type": "v9-8"}, "us-central2-b offers"),
        ({"runtime_version": "nope"}, "has no runtime version nope"),
        ({"provisioning": "on-demand"}, "no allowance for on-demand v4 chips"),
        ({"zone": "europe-west4-a"}, "Select a valid choice"),
        ({"name": "TPU 5"}, "lowercase letters"),
    ],
)
def test_a_refused_form_shows_why_and_stores_nothing(
    client, cast, lab, tpu_emulator, fields, message
):
    client.force_login(cast.admin)
    answer = client.post(reverse("vm_create", args=[lab.slug]), form(**fields))
    assert answer.status_code == 400
    assert message in answer.content.decode()
    assert not VmRequest.objects.exists()
    assert tpu_emulator.requests["CreateQueuedResource"] == 0


def test_a_waiting_request_is_cancelled_from_the_page(client, cast, lab, tpu_emulator):
    from tpus.services import vm_request_work

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    client.force_login(cast.admin)
    client.post(reverse("vm_create", args=[lab.slug]), form())
    made = VmRequest.objects.get()
    vm_request_work.send(made.pk)
    assert (
        "Waiting for resources"
        in client.get(reverse("vm_create", args=[lab.slug])).content.decode()
    )
    answer = client.post(reverse("vm_request_cancel", args=[lab.slug, made.pk]))
    assert answer.status_code == 302
    made.refresh_from_db()
    assert made.state == "cancelled"
    assert tpu_emulator.controls.queued_resources() == {}


def test_the_site_admin_sets_the_allowance_and_a_lab_admin_cannot(client, cast, lab):
    url = reverse("allowance_set", args=[lab.slug])
    client.force_login(cast.admin)
    assert (
        client.post(url, {"generation": "v4", "provisioning": "spot", "chips": "64"}).status_code
        == 403
    )
    client.force_login(cast.site_admin)
    client.post(url, {"generation": "v3", "provisioning": "on-demand", "chips": "20"})
    assert LabAllowance.objects.get(lab=lab, generation="v3").chips == 20
    client.post(url, {"generation": "v4", "provisioning": "spot", "chips": "0"})
    assert not LabAllowance.objects.filter(lab=lab, generation="v4").exists()
    client.post(url, {"generation": "v9", "provisioning": "spot", "chips": "-1"})
    assert LabAllowance.objects.filter(lab=lab).count() == 1
    assert AuditEvent.objects.filter(action="lab.allowance_set").count() == 2


def test_a_failed_request_is_tried_again_from_the_page(client, cast, lab, tpu_emulator):
    client.force_login(cast.admin)
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    client.post(reverse("vm_create", args=[lab.slug]), form())
    made = VmRequest.objects.get()
    VmRequest.objects.filter(pk=made.pk).update(state="failed", error="tpu5 was not made.")
    page = client.get(reverse("vm_create", args=[lab.slug])).content.decode()
    assert "Try tpu5 again" in page
    answer = client.post(reverse("vm_request_retry", args=[lab.slug, made.pk]), follow=True)
    assert "tpu5 is asked for again: it waits for capacity." in answer.content.decode()
    assert VmRequest.objects.exclude(pk=made.pk).get().is_open
    # Twice: the new request holds the name, and the page says so.
    answer = client.post(reverse("vm_request_retry", args=[lab.slug, made.pk]), follow=True)
    assert "already under way" in answer.content.decode()
    assert VmRequest.objects.count() == 2

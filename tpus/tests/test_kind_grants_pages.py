"""The lab's "access by kind" page and the kind grants API: lab admins only, inside
their own lab (another lab's kind grant is a 404)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from accounts.services import create_token
from accounts.unix import choose_username
from tpus.models import Grant, KindGrant, TpuVm, Worker
from tpus.services.kind_grants import grant_kind

PIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def make_vm(lab, name, kind="v4-8"):
    vm = TpuVm.objects.create(
        lab=lab, name=name, zone="us-central1-f", source="manual", accelerator_type=kind
    )
    Worker.objects.create(
        vm=vm, index=0, external_ip=f"192.0.2.{TpuVm.objects.count() + 20}", host_keys=[PIN]
    )
    return vm


@pytest.fixture
def scene(cast):
    choose_username(cast.member, "milo")
    make_vm(cast.lab, "pool-a")
    make_vm(cast.lab, "pool-b")
    make_vm(cast.lab, "big", "v4-32")
    return cast


def bearer(user):
    return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}


def test_an_admin_grants_a_kind_on_the_page_and_sees_how_many_vms_it_covers(client, scene):
    client.force_login(scene.admin)
    url = reverse("kind_grants", args=[scene.lab.slug])
    page = client.get(url)
    assert b'<option value="v4-8">' in page.content and b'<option value="v4-32">' in page.content
    response = client.post(url, {"user": "milo", "accelerator_type": "v4-8", "sudo": "on"})
    assert response.status_code == 302
    kind = KindGrant.objects.get()
    assert (kind.user, kind.accelerator_type, kind.sudo) == (scene.member, "v4-8", True)
    page = client.get(url).content.decode()
    assert '<td data-label="VMs">2</td>' in page
    assert reverse("kind_grant_revoke", args=[scene.lab.slug, kind.pk]) in page
    # The VM grants it made say where they came from.
    vm = TpuVm.objects.get(name="pool-a")
    access_page = client.get(reverse("vm_access", args=[scene.lab.slug, vm.pk])).content.decode()
    assert "from v4-8 grant" in access_page
    member_page = client.get(
        reverse("member_grant", args=[scene.lab.slug, scene.member_membership.pk])
    ).content.decode()
    assert member_page.count("from v4-8 grant") == 2


def test_an_unknown_kind_on_the_page_is_refused_with_the_reason_and_nothing_stored(client, scene):
    client.force_login(scene.admin)
    response = client.post(
        reverse("kind_grants", args=[scene.lab.slug]), {"user": "milo", "accelerator_type": "v9-8"}
    )
    assert response.status_code == 200
    assert "Vision Lab has no v9-8 and no allowance for v9 chips." in response.content.decode()
    assert not KindGrant.objects.exists() and not Grant.objects.exists()


def test_revoking_on_the_page_takes_back_the_vms_it_gave(client, scene):
    kind = grant_kind(scene.admin, scene.lab, scene.member, "v4-8", sudo=False)
    client.force_login(scene.admin)
    response = client.post(reverse("kind_grant_revoke", args=[scene.lab.slug, kind.pk]))
    assert response.status_code == 302
    assert set(Grant.objects.values_list("state", flat=True)) == {"revoking"}


def test_another_labs_kind_grant_is_a_404_for_an_admin_of_this_lab(client, scene, add_member):
    choose_username(scene.outsider, "eve")
    make_vm(scene.other_lab, "theirs")
    theirs = grant_kind(scene.outsider, scene.other_lab, scene.outsider, "v4-8", sudo=False)
    client.force_login(scene.admin)
    page = reverse("kind_grant_revoke", args=[scene.lab.slug, theirs.pk])
    assert client.post(page).status_code == 404
    api = f"/api/v1/labs/{scene.lab.slug}/kind-grants/{theirs.pk}/revoke"
    assert client.post(api, **bearer(scene.admin)).status_code == 404
    assert client.get(reverse("kind_grants", args=[scene.other_lab.slug])).status_code == 404
    listed = client.get(f"/api/v1/labs/{scene.lab.slug}/kind-grants", **bearer(scene.admin))
    assert listed.json()["items"] == []
    theirs.refresh_from_db()
    assert theirs.state == "active"


def test_the_api_creates_lists_and_revokes_kind_grants(client, scene):
    headers = bearer(scene.admin)
    base = f"/api/v1/labs/{scene.lab.slug}/kind-grants"
    made = client.post(
        base,
        {"user_email": "milo@vision.example", "accelerator_type": "v4-8", "sudo": True},
        content_type="application/json",
        **headers,
    )
    assert made.status_code == 201, made.content
    body = made.json()
    assert (body["accelerator_type"], body["vms"], body["state"]) == ("v4-8", 2, "active")
    listed = client.get(base, **headers).json()
    assert [(k["user"], k["vms"]) for k in listed["items"]] == [("milo@vision.example", 2)]
    grants = client.get(f"/api/v1/labs/{scene.lab.slug}/grants", **headers).json()["items"]
    assert {g["from_kind"] for g in grants} == {"v4-8"}
    revoked = client.post(f"{base}/{body['id']}/revoke", **headers).json()
    assert (revoked["state"], revoked["vms"]) == ("revoked", 0)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"user_email": "milo@vision.example", "accelerator_type": "v9-8"}, "no v9-8"),
        ({"user_email": "milo@vision.example", "accelerator_type": "v4 8"}, "not an accelerator"),
        (
            {
                "user_email": "milo@vision.example",
                "accelerator_type": "v4-8",
                "expires_on": "2001-01-01",
            },
            "must be in the future",
        ),
        ({"user_email": "eve@other.example", "accelerator_type": "v4-8"}, "not a member"),
        (
            {"user_email": "pat@vision.example", "accelerator_type": "v4-8"},
            "not an approved member",
        ),
    ],
)
def test_the_api_refuses_a_bad_kind_grant_with_the_reason_and_stores_nothing(
    client, scene, payload, message
):
    response = client.post(
        f"/api/v1/labs/{scene.lab.slug}/kind-grants",
        payload,
        content_type="application/json",
        **bearer(scene.admin),
    )
    assert response.status_code == 400
    assert message in response.json()["detail"]
    assert not KindGrant.objects.exists() and not Grant.objects.exists()


def test_the_page_costs_the_same_queries_however_many_kind_grants(client, scene, make_user):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tpus.models import Membership

    client.force_login(scene.admin)
    url = reverse("kind_grants", args=[scene.lab.slug])

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get(url).status_code == 200
        return len(captured)

    def add(count: int) -> None:
        for _ in range(count):
            person = make_user()
            Membership.objects.create(lab=scene.lab, user=person, state="approved")
            KindGrant.objects.create(lab=scene.lab, user=person, accelerator_type="v4-8")

    add(1)
    few = queries()
    add(10)
    assert queries() == few

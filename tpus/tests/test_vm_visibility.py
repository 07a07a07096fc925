"""Which VMs a member may open: any VM they hold a grant on that is not revoked,
whatever happened to other people's grants on the same VM."""

from __future__ import annotations

import pytest
from django.urls import reverse

from accounts.services import create_token
from tpus.models import Grant, TpuVm, Worker


@pytest.fixture
def shared_vm(cast, make_user, add_member):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="imported")
    Worker.objects.create(vm=vm, index=0, external_ip="198.18.0.5")
    return vm


def _pages(client, cast, vm, user):
    client.force_login(user)
    html = client.get(reverse("vm_detail", args=[cast.lab.slug, vm.pk])).status_code
    token = create_token(user, "test")[1]
    api = client.get(
        f"/api/v1/labs/{cast.lab.slug}/vms/{vm.pk}/ip-history",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    ).status_code
    return html, api


def test_a_member_still_sees_a_vm_after_someone_elses_grant_on_it_is_revoked(
    client, cast, shared_vm, make_user, add_member
):
    Grant.objects.create(user=cast.member, vm=shared_vm, state="active")
    former = make_user("former@vision.example")
    add_member(cast.lab, former)
    Grant.objects.create(user=former, vm=shared_vm, state="revoked")
    assert _pages(client, cast, shared_vm, cast.member) == (200, 200)


def test_a_member_whose_own_grant_is_revoked_gets_a_404(client, cast, shared_vm, make_user):
    Grant.objects.create(user=cast.member, vm=shared_vm, state="revoked")
    assert _pages(client, cast, shared_vm, cast.member) == (404, 404)


def test_a_member_without_a_grant_gets_a_404_even_when_others_have_one(
    client, cast, shared_vm, make_user, add_member
):
    other = make_user("other@vision.example")
    add_member(cast.lab, other)
    Grant.objects.create(user=other, vm=shared_vm, state="active")
    assert _pages(client, cast, shared_vm, cast.member) == (404, 404)

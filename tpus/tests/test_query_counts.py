"""The number of queries a page makes does not grow with the data on it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from accounts.models import UnixAccount
from tpus.models import Grant, Membership, TpuVm, Worker, WorkerSync


def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as context:
        assert client.get(url).status_code == 200
    return len(context)


@pytest.fixture
def crowd(cast, make_user):
    """Adds ``n`` more members, each with a grant on tpu5 and tpu6."""
    vms = []
    for name in ("tpu5", "tpu6"):
        vm = TpuVm.objects.create(lab=cast.lab, name=name, zone="us-central1-f", source="manual")
        for index in range(4):
            worker = Worker.objects.create(vm=vm, index=index, external_ip=f"192.0.2.{index + 1}")
            WorkerSync.objects.create(worker=worker, last_report={"values": {"changed": "0"}})
        vms.append(vm)
    counter = iter(range(10_000))

    def grow(n):
        for _ in range(n):
            i = next(counter)
            user = make_user(f"member{i}@vision.example")
            Membership.objects.create(lab=cast.lab, user=user, state="approved")
            UnixAccount.objects.create(user=user, username=f"member{i}", uid=30_000 + i)
            for vm in vms:
                Grant.objects.create(user=user, vm=vm, state="active")

    grow.vms = vms
    return grow


@pytest.mark.parametrize("page", ["lab_admin", "vm_detail", "vm_list", "dashboard", "lab_detail"])
def test_pages_make_as_many_queries_for_thirty_people_as_for_three(client, cast, crowd, page):
    client.force_login(cast.admin)
    url = {
        "lab_admin": reverse("lab_admin", args=[cast.lab.slug]),
        "vm_detail": reverse("vm_detail", args=[cast.lab.slug, crowd.vms[0].pk]),
        "vm_list": reverse("vm_list", args=[cast.lab.slug]),
        "dashboard": reverse("dashboard"),
        "lab_detail": reverse("lab_detail", args=[cast.lab.slug]),
    }[page]
    crowd(3)
    few = _queries(client, url)
    crowd(27)
    assert _queries(client, url) == few


def test_a_members_ssh_page_does_not_grow_with_their_vms(client, cast, crowd):
    crowd(1)
    member = Grant.objects.filter(vm=crowd.vms[0]).first().user
    client.force_login(member)
    few = _queries(client, reverse("ssh_page"))
    for i in range(10):
        vm = TpuVm.objects.create(
            lab=cast.lab, name=f"extra{i}", zone="us-central1-f", source="manual"
        )
        Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.50")
        Grant.objects.create(user=member, vm=vm, state="active")
    assert _queries(client, reverse("ssh_page")) == few

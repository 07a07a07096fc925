"""The number of queries a page makes does not grow with the data on it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from accounts.models import UnixAccount
from portal import audit
from tpus.models import (
    AuditAction,
    AuditEvent,
    Grant,
    IpChange,
    Membership,
    TpuVm,
    Worker,
    WorkerSync,
)


def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as context:
        assert client.get(url).status_code == 200
    return len(context)


@pytest.fixture
def crowd(cast, make_user):
    """Adds ``n`` more members, each with a TPU VM of their own, a grant on it and on
    tpu5 and tpu6, an address change on tpu5 and two audit events."""
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
            own = TpuVm.objects.create(
                lab=cast.lab, name=f"own{i}", zone="us-central1-f", source="manual"
            )
            Worker.objects.create(vm=own, index=0, external_ip="192.0.2.99")
            for vm in (*vms, own):
                Grant.objects.create(user=user, vm=vm, state="active")
            worker = vms[0].workers.get(index=i % 4)
            IpChange.objects.create(
                worker=worker, old_ip="192.0.2.1", new_ip=f"198.51.100.{i % 250}"
            )
            for action in (AuditAction.GRANT_CREATED, AuditAction.GRANT_ACTIVE):
                audit.record(action, actor=cast.admin, lab=cast.lab, target_user=user)

    grow.vms = vms
    return grow


ADMIN_PAGES = [
    "lab_admin",
    "lab_admin_search",
    "vm_detail",
    "vm_access",
    "vm_progress",
    "vm_list",
    "vm_list_filtered",
    "dashboard",
    "lab_detail",
    "lab_audit",
    "lab_audit_older",
    "member_grant",
    "people_search",
    "vm_search",
]


def _admin_url(page, cast, crowd):
    lab, vm = cast.lab.slug, crowd.vms[0].pk
    newest = AuditEvent.objects.filter(lab=cast.lab).order_by("created_at", "id").last()
    return {
        "lab_admin": reverse("lab_admin", args=[lab]),
        "lab_admin_search": reverse("lab_admin", args=[lab]) + "?q=member&state=approved",
        "vm_detail": reverse("vm_detail", args=[lab, vm]),
        "vm_access": reverse("vm_access", args=[lab, vm]),
        "vm_progress": reverse("vm_progress", args=[lab, vm]),
        "vm_list": reverse("vm_list", args=[lab]),
        "vm_list_filtered": reverse("vm_list", args=[lab]) + "?name=own&zone=us-central1-f",
        "dashboard": reverse("dashboard"),
        "lab_detail": reverse("lab_detail", args=[lab]),
        "lab_audit": reverse("lab_audit", args=[lab]),
        "lab_audit_older": reverse("lab_audit", args=[lab]) + f"?older={newest.pk}",
        "member_grant": reverse("member_grant", args=[lab, cast.member_membership.pk]),
        "people_search": reverse("people_search", args=[lab]) + "?user=member",
        "vm_search": reverse("vm_search", args=[lab]) + "?vm=own",
    }[page]


@pytest.mark.parametrize("page", ADMIN_PAGES)
def test_admin_pages_make_as_many_queries_for_sixty_people_as_for_three(client, cast, crowd, page):
    client.force_login(cast.admin)
    crowd(3)
    url = _admin_url(page, cast, crowd)
    _queries(client, url)  # the first visit makes the lab's key pair, once
    few = _queries(client, url)
    crowd(57)
    assert _queries(client, _admin_url(page, cast, crowd)) == few


@pytest.mark.parametrize("page", ["lab_detail", "vm_detail", "dashboard"])
def test_a_members_pages_make_as_many_queries_in_a_big_lab_as_in_a_small_one(
    client, cast, crowd, page
):
    crowd(3)
    member = Grant.objects.filter(vm=crowd.vms[0]).first().user
    client.force_login(member)
    url = _admin_url(page, cast, crowd)
    few = _queries(client, url)
    crowd(57)
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

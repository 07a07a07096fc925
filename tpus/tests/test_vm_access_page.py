"""A VM's two pages for its lab's admins: the overview (workers, connection, how many
people have access, jobs, disks, addresses) and the access page (give access, follow
it onto every worker, see, retry or revoke everyone's access)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from accounts.models import UnixAccount
from tpus.models import Grant, TpuVm, Worker

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIN8crqCQZGXDCh9KBbBRI4EGkWOX2SOeVCa1joX0XTan"


@pytest.fixture
def tpu5(cast, make_user):
    """A pinned two-worker pod: two people with access, one being added, one failed,
    one revoked."""
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    for i in range(2):
        Worker.objects.create(vm=vm, index=i, external_ip=f"192.0.2.{10 + i}", host_keys=[KEY])
    for i, state in enumerate(["active", "active", "pending", "failed", "revoked"]):
        user = make_user(f"p{i}@vision.example")
        UnixAccount.objects.create(user=user, username=f"p{i}", uid=34_000 + i)
        Grant.objects.create(user=user, vm=vm, state=state, error="host said no" * (i == 3))
    return vm


def _tabs(body: str) -> str:
    return body[body.index('<nav class="tabs"') : body.index("</nav>", body.index('class="tabs"'))]


def test_the_overview_says_how_many_have_access_and_links_to_the_access_page(client, cast, tpu5):
    client.force_login(cast.admin)
    body = client.get(reverse("vm_detail", args=["vision", tpu5.pk])).content.decode()
    access_url = reverse("vm_access", args=["vision", tpu5.pk])
    assert "2 people have access · 1 change on its way · " in body
    assert '<span class="badge failed">1 failed</span>' in body
    assert f'href="{access_url}">Give, retry or revoke access</a>' in body
    assert 'aria-current="page">Overview</a>' in _tabs(body)
    # The workers and their keys stay here; giving and listing access moved.
    assert "tpu5-w1" in body and "ssh-ed25519 SHA256:" in body
    assert "Add to tpu5" not in body and 'id="vm-access"' not in body
    assert 'id="vm-progress"' not in body


def test_the_access_page_gives_follows_and_lists_access(client, cast, tpu5):
    client.force_login(cast.admin)
    body = client.get(reverse("vm_access", args=["vision", tpu5.pk])).content.decode()
    assert 'aria-current="page">Access</a>' in _tabs(body)
    assert "Add to tpu5" in body
    assert 'id="vm-progress"' in body and 'hx-trigger="every 1s"' in body  # one is pending
    # Everyone, revoked included, with their state; the failed one can be retried.
    rows = {g.user.email: g for g in Grant.objects.filter(vm=tpu5)}
    for email, grant in rows.items():
        assert f'id="access-{grant.pk}"' in body, email
    failed = rows["p3@vision.example"]
    assert reverse("grant_retry", args=["vision", failed.pk]) in body
    assert "host said no" in body
    revoked = rows["p4@vision.example"]
    assert reverse("grant_revoke", args=["vision", revoked.pk]) not in body


def test_the_overview_of_a_vm_no_one_uses_says_so(client, cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu6", zone="us-central1-f", source="manual")
    client.force_login(cast.admin)
    body = client.get(reverse("vm_detail", args=["vision", vm.pk])).content.decode()
    assert "No one has access yet." in body
    assert "on its way" not in body and "failed</span>" not in body


def test_giving_retrying_and_revoking_lead_back_to_the_access_page(client, cast, tpu5):
    client.force_login(cast.admin)
    access_url = reverse("vm_access", args=["vision", tpu5.pk])
    failed = Grant.objects.get(vm=tpu5, state="failed")
    active = Grant.objects.filter(vm=tpu5, state="active").first()
    retry = client.post(reverse("grant_retry", args=["vision", failed.pk]))
    assert retry.status_code == 302 and retry.url == access_url
    revoke = client.post(reverse("grant_revoke", args=["vision", active.pk]))
    assert revoke.status_code == 302 and revoke.url == access_url
    refused = client.post(reverse("grant_create", args=["vision", tpu5.pk]), {"user": "nobody"})
    assert refused.status_code == 302 and refused.url == access_url
    assert Grant.objects.filter(vm=tpu5).count() == 5  # the refusal stored nothing


def test_a_member_sees_neither_tabs_nor_the_access_page(client, cast, tpu5):
    UnixAccount.objects.create(user=cast.member, username="milo", uid=33_000)
    Grant.objects.create(user=cast.member, vm=tpu5, state="active")
    client.force_login(cast.member)
    body = client.get(reverse("vm_detail", args=["vision", tpu5.pk])).content.decode()
    assert 'class="tabs"' not in body and "people have access" not in body
    assert client.get(reverse("vm_access", args=["vision", tpu5.pk])).status_code == 403


def test_the_job_form_follows_the_viewers_own_grant(client, cast, tpu5):
    """The overview reads the viewer's own grant once: it says whether they may run
    jobs, for a member and for an admin alike."""
    url = reverse("vm_detail", args=["vision", tpu5.pk])
    UnixAccount.objects.create(user=cast.admin, username="boss", uid=33_001)
    client.force_login(cast.admin)
    body = client.get(url).content.decode()
    assert "Queue on tpu5" not in body
    assert f'href="{reverse("vm_access", args=["vision", tpu5.pk])}">its access page</a>' in body
    grant = Grant.objects.create(user=cast.admin, vm=tpu5, state="pending")
    assert "Queue on tpu5" not in client.get(url).content.decode()
    Grant.objects.filter(pk=grant.pk).update(state="active")
    assert "Queue on tpu5" in client.get(url).content.decode()

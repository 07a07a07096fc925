"""What a product review of the pages asked for: every lab page links back to its
lab, a site admin with no labs is pointed to creating one, the invite fields are
labelled, and destructive buttons are marked as such."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from accounts.keys import add_key
from accounts.services import create_token
from accounts.tests.keydata import ED25519
from tpus.models import DataDisk, DiskAttachment, Lab, TpuVm, Worker


@pytest.fixture
def vm(cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10", host_keys=[ED25519])
    return vm


def _back_link(body: str, slug: str) -> bool:
    return bool(
        re.search(rf'<nav class="crumbs" aria-label="Breadcrumb"><a href="/labs/{slug}/">', body)
    )


def test_every_lab_sub_page_links_back_to_the_lab(client, cast, vm):
    disk = DataDisk.objects.create(lab=cast.lab, name="imagenet", zone="us-central1-f")
    slug = cast.lab.slug
    client.force_login(cast.admin)
    for url in (
        reverse("lab_admin", args=[slug]),
        reverse("lab_settings", args=[slug]),
        reverse("lab_audit", args=[slug]),
        reverse("vm_list", args=[slug]),
        reverse("vm_detail", args=[slug, vm.pk]),
        reverse("vm_access", args=[slug, vm.pk]),
        reverse("worker_keys", args=[slug, vm.pk, 0]),
        reverse("member_grant", args=[slug, cast.member_membership.pk]),
        reverse("disk_register", args=[slug]),
        reverse("disk_detail", args=[slug, disk.pk]),
        reverse("lab_join", args=[slug]),
    ):
        response = client.get(url)
        assert response.status_code == 200, url
        assert _back_link(response.content.decode(), slug), url
    # The lab's own page does not link to itself.
    assert not _back_link(client.get(reverse("lab_detail", args=[slug])).content.decode(), slug)


def test_a_site_admin_without_labs_is_pointed_to_creating_one(client, make_user, db):
    root = make_user("root@portal.example", is_superuser=True, is_staff=True)
    client.force_login(root)
    assert not Lab.objects.exists()
    body = client.get(reverse("dashboard")).content.decode()
    assert "There are no labs yet." in body
    assert f'<a href="{reverse("lab_create")}">Create a lab</a>' in body


def test_someone_who_is_not_a_site_admin_is_not_offered_to_create_a_lab(client, make_user):
    client.force_login(make_user())
    body = client.get(reverse("dashboard")).content.decode()
    assert reverse("lab_create") not in body
    assert "Find your lab" in body


def test_the_invite_fields_are_labelled(client, cast):
    client.force_login(cast.admin)
    body = client.get(reverse("lab_admin", args=[cast.lab.slug])).content.decode()
    assert re.search(r'<label for="id_email">Email <span class="required">\(optional\)', body)
    assert '<label for="id_role">Role</label>' in body
    assert 'id="id_email"' in body and 'id="id_role"' in body


def test_destructive_buttons_are_marked_destructive(client, cast, vm):
    from tpus.services.labs import create_invite

    create_invite(cast.admin, cast.lab)
    disk = DataDisk.objects.create(lab=cast.lab, name="imagenet", zone="us-central1-f")
    DiskAttachment.objects.create(disk=disk, vm=vm)
    slug = cast.lab.slug
    client.force_login(cast.admin)
    pages = {
        reverse("lab_admin", args=[slug]): ">Revoke<",
        reverse("disk_detail", args=[slug, disk.pk]): ">Detach<",
    }
    for url, label in pages.items():
        body = client.get(url).content.decode()
        buttons = re.findall(rf'<button[^>]*class="([^"]*)"[^>]*{label}', body)
        assert buttons and all("danger" in b for b in buttons), (url, label, buttons)
    client.force_login(cast.member)
    create_token(cast.member, "laptop")
    add_key(cast.member, ED25519, "laptop")
    tokens = client.get(reverse("token_list")).content.decode()
    assert re.search(r'<button class="danger">Revoke</button>', tokens)
    keys = client.get(reverse("key_list")).content.decode()
    assert re.search(r'<a class="button danger" href="[^"]+">Delete</a>', keys)

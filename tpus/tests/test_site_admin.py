"""The site admin's pages load for every model, and their few actions go through the
services."""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse

from tpus.models import Grant, TpuVm


def test_every_changelist_loads_for_a_site_admin(client, cast):
    client.force_login(cast.site_admin)
    for model in admin.site._registry:
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        assert client.get(url).status_code == 200, url


def test_the_site_admin_is_closed_to_everyone_else(client, cast):
    client.force_login(cast.admin)
    response = client.get(reverse("admin:index"))
    assert response.status_code == 302


def test_revoking_from_the_site_admin_uses_the_service(client, cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    grant = Grant.objects.create(user=cast.member, vm=vm, state="active")
    client.force_login(cast.site_admin)
    client.post(
        reverse("admin:tpus_grant_changelist"),
        {"action": "revoke", "_selected_action": [grant.pk]},
    )
    grant.refresh_from_db()
    assert grant.state == "revoking"
    vm.refresh_from_db()
    assert vm.desired_version == 1


def test_deactivating_someone_stops_their_sign_in(client, cast):
    client.force_login(cast.site_admin)
    client.post(
        reverse("admin:accounts_user_changelist"),
        {"action": "deactivate", "_selected_action": [cast.member.pk]},
    )
    cast.member.refresh_from_db()
    assert not cast.member.is_active


def _edit_user(client, user, **changes):
    data = {
        "full_name": user.full_name,
        "is_active": "on" if user.is_active else "",
        "is_staff": "on" if user.is_staff else "",
        "is_superuser": "on" if user.is_superuser else "",
    }
    data.update(changes)
    return client.post(reverse("admin:accounts_user_change", args=[user.pk]), data)


def test_deactivating_someone_in_the_edit_form_asks_for_a_reconcile_of_their_vms(
    client, cast, django_capture_on_commit_callbacks
):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    client.force_login(cast.site_admin)
    with django_capture_on_commit_callbacks() as callbacks:
        response = _edit_user(client, cast.member, is_active="")
    assert response.status_code == 302
    cast.member.refresh_from_db()
    assert not cast.member.is_active
    vm.refresh_from_db()
    assert vm.desired_version == 1
    assert callbacks, "a reconcile is enqueued after commit"


def test_deactivating_in_the_edit_form_matches_the_bulk_action(client, cast):
    vm_a = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    vm_b = TpuVm.objects.create(lab=cast.lab, name="tpu6", zone="us-central1-f", source="manual")
    Grant.objects.create(user=cast.member, vm=vm_a, state="active")
    Grant.objects.create(user=cast.outsider, vm=vm_b, state="active")
    client.force_login(cast.site_admin)
    _edit_user(client, cast.member, is_active="")
    client.post(
        reverse("admin:accounts_user_changelist"),
        {"action": "deactivate", "_selected_action": [cast.outsider.pk]},
    )
    vm_a.refresh_from_db()
    vm_b.refresh_from_db()
    assert (vm_a.desired_version, vm_b.desired_version) == (1, 1)


def test_saving_the_edit_form_without_changing_active_asks_for_nothing(client, cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    client.force_login(cast.site_admin)
    assert _edit_user(client, cast.member, full_name="Milo M.").status_code == 302
    vm.refresh_from_db()
    assert vm.desired_version == 0

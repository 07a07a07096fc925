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

"""Every lab URL against every kind of visitor. Another lab's object is a 404, never a
403 that would confirm it exists; a member of the lab who is not an admin gets a 403
on admin pages (they know the lab exists)."""

from __future__ import annotations

import hashlib
import re

import pytest
from django.urls import reverse

from accounts.tests.keydata import ECDSA_256
from tpus.models import HostKeyScan, TpuVm, Worker

ROLES = ["anonymous", "outsider", "pending", "member", "admin", "site_admin"]

# (name, method, url builder, expected status per role). 302 for anonymous means "sent
# to sign in".
OK, REDIRECT, FORBIDDEN, MISSING = 200, 302, 403, 404
ADMINS_ONLY = [401, MISSING, MISSING, FORBIDDEN, OK, OK]
# A workdir snapshot's one file: the body the matrix sends a PUT, "{}".
_EMPTY_JSON_SHA = hashlib.sha256(b"{}").hexdigest()
_SNAPSHOT_FILE = {"path": "a.py", "size": 2, "mode": 420, "sha256": _EMPTY_JSON_SHA}


def _urls(cast):
    from accounts.keys import add_key
    from accounts.models import User
    from accounts.services import create_token
    from accounts.tests.keydata import ECDSA_384, ED25519
    from tpus.models import DataDisk, Grant, KindGrant, Membership, TpuVm, VmRequest, Worker
    from tpus.models.inventory import DiskOperation
    from tpus.services.labs import create_invite

    lab, pm = cast.lab.slug, cast.pending_membership.pk
    second = Membership.objects.create(
        lab=cast.lab, user=User.objects.create_user("second@vision.example"), state="requested"
    )
    # Someone the lab's admins make an admin and then remove, through the API.
    third = Membership.objects.create(
        lab=cast.lab, user=User.objects.create_user("third@vision.example"), state="approved"
    )
    invite, _ = create_invite(cast.admin, cast.lab)
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10")
    disk = DataDisk.objects.create(lab=cast.lab, name="imagenet", zone="us-central1-f")
    grant = Grant.objects.create(user=cast.member, vm=vm, state="failed")
    kind = KindGrant.objects.create(lab=cast.lab, user=cast.member, accelerator_type="v4-8")
    operation = DiskOperation.objects.create(disk=disk, vm=vm, action="attach")
    job = _ended_job(vm, cast.member)
    vm_request = VmRequest.objects.create(
        lab=cast.lab,
        name="tpu7",
        zone="us-central1-f",
        accelerator_type="v4-8",
        runtime_version="tpu-ubuntu2204-base",
        state="failed",
    )
    jobs = f"labs/{lab}/vms/{vm.pk}/jobs/{job.pk}"
    token, _ = create_token(cast.admin, "admin's token")
    key = add_key(cast.member, ED25519, "member's laptop")
    api_key = add_key(cast.member, ECDSA_384, "member's desktop")
    return [
        ("dashboard", "get", reverse("dashboard"), [REDIRECT, OK, OK, OK, OK, OK]),
        ("lab_list", "get", reverse("lab_list"), [REDIRECT, OK, OK, OK, OK, OK]),
        (
            "lab_create",
            "get",
            reverse("lab_create"),
            [REDIRECT, FORBIDDEN, FORBIDDEN, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            "lab_detail",
            "get",
            reverse("lab_detail", args=[lab]),
            [REDIRECT, MISSING, OK, OK, OK, OK],
        ),
        ("lab_join", "get", reverse("lab_join", args=[lab]), [REDIRECT, MISSING, OK, OK, OK, OK]),
        (
            "lab_admin",
            "get",
            reverse("lab_admin", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "lab_settings",
            "get",
            reverse("lab_settings", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # A lab admin's attempt to set the lab's GCP project: site admins only (their
            # incomplete form is shown again).
            "lab_settings_project",
            "post",
            reverse("lab_settings", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            # Moving the lab's grant end date (which gives access back): site admins only.
            "lab_settings_grant_end",
            "post",
            reverse("lab_settings", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            "lab_audit",
            "get",
            reverse("lab_audit", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "people_search",
            "get",
            reverse("people_search", args=[lab]) + "?user=milo",
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "membership_approve",
            "post",
            reverse("membership_approve", args=[lab, pm]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "membership_reject",
            "post",
            reverse("membership_reject", args=[lab, pm]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "membership_role",
            "post",
            reverse("membership_role", args=[lab, cast.member_membership.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "membership_share",
            "post",
            reverse("membership_share", args=[lab, cast.member_membership.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "membership_remove",
            "post",
            reverse("membership_remove", args=[lab, cast.member_membership.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "invite_create",
            "post",
            reverse("invite_create", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "policy_accept",
            "post",
            reverse("policy_accept", args=[lab]),
            [REDIRECT, MISSING, MISSING, REDIRECT, REDIRECT, REDIRECT],
        ),
        (
            "invite_revoke",
            "post",
            reverse("invite_revoke", args=[lab, invite.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "invite",
            "get",
            reverse("invite", args=["made-up-token"]),
            [REDIRECT, MISSING, MISSING, MISSING, MISSING, MISSING],
        ),
        ("token_list", "get", reverse("token_list"), [REDIRECT, OK, OK, OK, OK, OK]),
        (
            "token_revoke",
            "post",
            reverse("token_revoke", args=[token.pk]),
            [REDIRECT, MISSING, MISSING, MISSING, REDIRECT, MISSING],
        ),
        ("key_list", "get", reverse("key_list"), [REDIRECT, OK, OK, OK, OK, OK]),
        (
            "key_delete_confirm",
            "get",
            reverse("key_delete", args=[key.pk]),
            [REDIRECT, MISSING, MISSING, OK, MISSING, MISSING],
        ),
        (
            "key_delete",
            "post",
            reverse("key_delete", args=[key.pk]),
            [REDIRECT, MISSING, MISSING, REDIRECT, MISSING, MISSING],
        ),
        ("unix_username", "post", reverse("unix_username"), [REDIRECT, OK, OK, OK, OK, OK]),
        ("api_me", "get", "/api/v1/me", [401, OK, OK, OK, OK, OK]),
        ("api_labs", "get", "/api/v1/labs", [401, OK, OK, OK, OK, OK]),
        (
            "api_lab_create",
            "post",
            "/api/v1/labs",
            [401, FORBIDDEN, FORBIDDEN, FORBIDDEN, FORBIDDEN, 201],
        ),
        (
            "api_lab",
            "get",
            f"/api/v1/labs/{lab}",
            [401, MISSING, OK, OK, OK, OK],
        ),
        (
            "api_lab_memberships",
            "get",
            f"/api/v1/labs/{lab}/memberships",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_approve",
            "post",
            f"/api/v1/labs/{lab}/memberships/{pm}/approve",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_reject",
            "post",
            f"/api/v1/labs/{lab}/memberships/{second.pk}/reject",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        ("api_memberships", "get", "/api/v1/memberships", [401, OK, OK, OK, OK, OK]),
        ("api_keys", "get", "/api/v1/keys", [401, OK, OK, OK, OK, OK]),
        ("api_key_add", "post", "/api/v1/keys", [401, 201, 201, 201, 201, 201]),
        (
            "api_key_delete",
            "delete",
            f"/api/v1/keys/{api_key.pk}",
            [401, MISSING, MISSING, 204, MISSING, MISSING],
        ),
        ("api_unix_account", "get", "/api/v1/unix-account", [401, OK, OK, OK, OK, OK]),
        ("api_unix_account_set", "put", "/api/v1/unix-account", [401, OK, OK, OK, OK, OK]),
        ("api_tokens", "get", "/api/v1/tokens", [401, OK, OK, OK, OK, OK]),
        ("api_token_create", "post", "/api/v1/tokens", [401, 201, 201, 201, 201, 201]),
        (
            "api_token_revoke",
            "delete",
            f"/api/v1/tokens/{token.pk}",
            [401, MISSING, MISSING, MISSING, 204, MISSING],
        ),
        # A browser session carries no token to revoke.
        ("api_token_revoke_current", "delete", "/api/v1/tokens/current", [401] + [400] * 5),
        # Signing in a device is open to anyone; approving it needs a signed-in person.
        ("api_device_codes", "post", "/api/v1/device/codes", [201] * 6),
        ("api_device_token", "post", "/api/v1/device/token", [400] * 6),
        ("device_login", "get", reverse("device_login"), [REDIRECT, OK, OK, OK, OK, OK]),
        (
            "api_join",
            "post",
            f"/api/v1/labs/{lab}/join",
            [401, MISSING, 201, 201, 201, 201],
        ),
        (
            "api_member_role",
            "post",
            f"/api/v1/labs/{lab}/memberships/{third.pk}/role",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_member_share",
            "get",
            f"/api/v1/labs/{lab}/memberships/{third.pk}/share",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_member_share_set",
            "post",
            f"/api/v1/labs/{lab}/memberships/{third.pk}/share",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_member_remove",
            "post",
            f"/api/v1/labs/{lab}/memberships/{third.pk}/remove",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_lab_settings",
            "get",
            f"/api/v1/labs/{lab}/settings",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_lab_settings_update",
            "patch",
            f"/api/v1/labs/{lab}/settings",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # Moving the lab to another GCP project: site admins only.
            "api_lab_settings_project",
            "patch",
            f"/api/v1/labs/{lab}/settings",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            "api_lab_settings_grant_end",
            "patch",
            f"/api/v1/labs/{lab}/settings",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            "api_audit",
            "get",
            f"/api/v1/labs/{lab}/audit",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_invites",
            "get",
            f"/api/v1/labs/{lab}/invites",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_invite_create",
            "post",
            f"/api/v1/labs/{lab}/invites",
            [401, MISSING, MISSING, FORBIDDEN, 201, 201],
        ),
        (
            # Revoked already by the page above: the same answer again.
            "api_invite_revoke",
            "post",
            f"/api/v1/labs/{lab}/invites/{invite.pk}/revoke",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # Queued work: the sync runs after commit.
            "api_refresh",
            "post",
            f"/api/v1/labs/{lab}/refresh",
            [401, MISSING, MISSING, FORBIDDEN, 202, 202],
        ),
        (
            "api_disk_register",
            "post",
            f"/api/v1/labs/{lab}/disks/register",
            [401, MISSING, MISSING, FORBIDDEN, 201, 201],
        ),
        (
            "api_vm_register",
            "post",
            f"/api/v1/labs/{lab}/vms/register",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, 201],
        ),
        (
            "vm_list",
            "get",
            reverse("vm_list", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_import",
            "get",
            reverse("vm_import", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_create",
            "get",
            reverse("vm_create", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_request_cancel",
            "post",
            reverse("vm_request_cancel", args=[lab, vm_request.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "vm_request_retry",
            "post",
            reverse("vm_request_retry", args=[lab, vm_request.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        ("api_vm_requests", "get", f"/api/v1/labs/{lab}/vm-requests", ADMINS_ONLY),
        ("api_vm_request", "get", f"/api/v1/labs/{lab}/vm-requests/{vm_request.pk}", ADMINS_ONLY),
        (
            # Refused (no allowance): the check runs for the lab's admins only.
            "api_vm_request_create",
            "post",
            f"/api/v1/labs/{lab}/vm-requests",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_vm_request_cancel",
            "post",
            f"/api/v1/labs/{lab}/vm-requests/{vm_request.pk}/cancel",
            ADMINS_ONLY,
        ),
        (
            # Refused (the request is still open): 400 past the checks, for admins only.
            "api_vm_request_retry",
            "post",
            f"/api/v1/labs/{lab}/vm-requests/{vm_request.pk}/retry",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        ("api_allowances", "get", f"/api/v1/labs/{lab}/allowances", ADMINS_ONLY),
        (
            "api_allowance_set",
            "put",
            f"/api/v1/labs/{lab}/allowances",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            # A VM registered by hand (tpu5 here) cannot be changed: 400 past the checks.
            "api_vm_stop",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/stop",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_vm_start",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/start",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_vm_delete",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/delete",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "vm_power",
            "post",
            reverse("vm_power", args=[lab, vm.pk, "start"]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "vm_delete",
            "get",
            reverse("vm_delete", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # Only a site admin sets what the lab may hold (its TPU grant says so).
            "allowance_set",
            "post",
            reverse("allowance_set", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, REDIRECT],
        ),
        (
            "vm_register",
            "get",
            reverse("vm_register", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, OK],
        ),
        (
            "vm_register_post",
            "post",
            reverse("vm_register", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, REDIRECT],
        ),
        (
            "vm_sync",
            "post",
            reverse("vm_sync", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "vm_search",
            "get",
            reverse("vm_search", args=[lab]) + "?vm=tpu",
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_detail",
            "get",
            reverse("vm_detail", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "vm_access",
            "get",
            reverse("vm_access", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_progress",
            "get",
            reverse("vm_progress", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_connection",
            "get",
            reverse("vm_connection", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "vm_connect",
            "post",
            reverse("vm_connect", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "vm_disconnect",
            "post",
            reverse("vm_disconnect", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "grant_create",
            "post",
            reverse("grant_create", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "member_grant",
            "get",
            reverse("member_grant", args=[lab, cast.member_membership.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "grant_retry",
            "post",
            reverse("grant_retry", args=[lab, grant.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "grant_revoke",
            "post",
            reverse("grant_revoke", args=[lab, grant.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "kind_grants",
            "get",
            reverse("kind_grants", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # An empty form: shown again with what is missing.
            "kind_grants_post",
            "post",
            reverse("kind_grants", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "kind_grant_revoke",
            "post",
            reverse("kind_grant_revoke", args=[lab, kind.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            # An empty form: back to the kinds page, with what is missing.
            "elastic_pool_set",
            "post",
            reverse("elastic_pool_set", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        ("ssh_page", "get", reverse("ssh_page"), [REDIRECT, OK, OK, OK, OK, OK]),
        (
            "ssh_config",
            "get",
            reverse("ssh_config"),
            [REDIRECT, OK, OK, OK, OK, OK],
        ),
        (
            "ssh_known_hosts",
            "get",
            reverse("ssh_known_hosts"),
            [REDIRECT, OK, OK, OK, OK, OK],
        ),
        ("ssh_feed_rotate", "post", reverse("ssh_feed_rotate"), [REDIRECT] * 6),
        ("ssh_feed_disable", "post", reverse("ssh_feed_disable"), [REDIRECT] * 6),
        ("ssh_forwarding", "post", reverse("ssh_forwarding"), [REDIRECT] * 6),
        (
            # Port forwards are the person's own: only someone with a grant on the VM
            # (here the member, whose grant failed but is still wanted) reaches them.
            "ssh_forward",
            "post",
            reverse("ssh_forward", args=[vm.pk]),
            [REDIRECT, MISSING, MISSING, REDIRECT, MISSING, MISSING],
        ),
        (
            "ssh_forward_remove",
            "post",
            reverse("ssh_forward_remove", args=[vm.pk, 6006]),
            [REDIRECT, MISSING, MISSING, REDIRECT, MISSING, MISSING],
        ),
        (
            "ssh_feed_config",
            "get",
            reverse("ssh_feed_config", args=[f"{cast.member.pk}-forged"]),
            [MISSING] * 6,
        ),
        (
            "ssh_feed_known_hosts",
            "get",
            reverse("ssh_feed_known_hosts", args=["1-" + "0" * 40]),
            [MISSING] * 6,
        ),
        (
            "api_grants",
            "get",
            f"/api/v1/labs/{lab}/grants",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_grant_create",
            "post",
            f"/api/v1/labs/{lab}/grants",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            # The page's retry above has made the grant pending again: nothing to retry.
            "api_grant_retry",
            "post",
            f"/api/v1/labs/{lab}/grants/{grant.pk}/retry",
            [401, MISSING, MISSING, FORBIDDEN, 409, 409],
        ),
        (
            "api_grant_revoke",
            "post",
            f"/api/v1/labs/{lab}/grants/{grant.pk}/revoke",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_kind_grants",
            "get",
            f"/api/v1/labs/{lab}/kind-grants",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_kind_grant_create",
            "post",
            f"/api/v1/labs/{lab}/kind-grants",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_kind_grant_revoke",
            "post",
            f"/api/v1/labs/{lab}/kind-grants/{kind.pk}/revoke",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_elastic_pools",
            "get",
            f"/api/v1/labs/{lab}/elastic-pools",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_elastic_pool_set",
            "put",
            f"/api/v1/labs/{lab}/elastic-pools/v4-8",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        ("healthz", "get", "/healthz", [OK, OK, OK, OK, OK, OK]),
        ("api_my_grants", "get", "/api/v1/me/grants", [401, OK, OK, OK, OK, OK]),
        ("api_my_ssh_config", "get", "/api/v1/me/ssh-config", [401, OK, OK, OK, OK, OK]),
        ("api_my_known_hosts", "get", "/api/v1/me/known-hosts", [401, OK, OK, OK, OK, OK]),
        ("api_my_ssh_hosts", "get", "/api/v1/me/ssh-hosts", [401, OK, OK, OK, OK, OK]),
        (
            "api_ip_history",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/ip-history",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "worker_keys",
            "get",
            reverse("worker_keys", args=[lab, vm.pk, 0]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # An unsigned confirmation: refused with a message, nothing pinned.
            "worker_keys_pin",
            "post",
            reverse("worker_keys", args=[lab, vm.pk, 0]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "disk_progress",
            "get",
            reverse("disk_progress", args=[lab, disk.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_disk_operation",
            "get",
            f"/api/v1/labs/{lab}/disks/{disk.pk}/operations/{operation.pk}",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "disk_register",
            "get",
            reverse("disk_register", args=[lab]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "disk_detail",
            "get",
            reverse("disk_detail", args=[lab, disk.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "disk_detach",
            "post",
            reverse("disk_detach", args=[lab, disk.pk, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        ("api_vms", "get", f"/api/v1/labs/{lab}/vms", [401, MISSING, MISSING, FORBIDDEN, OK, OK]),
        (
            "api_vm",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_vm_connection",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/connection",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_vm_connect",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/connect",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_vm_disconnect",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/disconnect",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            # No alarm is up on tpu5's worker: nothing to resume.
            "api_worker_resume",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/workers/0/resume",
            [401, MISSING, MISSING, FORBIDDEN, 409, 409],
        ),
        (
            "api_vm_progress",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/progress",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_worker_keys",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/workers/0/host-keys",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            # Queued work: the scan runs after commit.
            "api_worker_keys_scan",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/workers/0/host-keys/scan",
            [401, MISSING, MISSING, FORBIDDEN, 202, 202],
        ),
        (
            # An unsigned confirmation: refused, nothing pinned.
            "api_worker_keys_pin",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/workers/0/host-keys/pin",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "worker_keys_resume",
            "post",
            reverse("worker_keys", args=[lab, vm.pk, 0]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            # Starts a scan as queued work (the task runs after commit).
            "worker_keys_scan_start",
            "post",
            reverse("worker_keys", args=[lab, vm.pk, 0]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, REDIRECT, REDIRECT],
        ),
        (
            "worker_keys_scan",
            "get",
            reverse("worker_keys_scan", args=[lab, vm.pk, 0]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_import_candidates",
            "get",
            f"/api/v1/labs/{lab}/import-candidates",
            [401, MISSING, MISSING, FORBIDDEN, 502, 502],
        ),
        (
            "api_import",
            "post",
            f"/api/v1/labs/{lab}/import",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_disks",
            "get",
            f"/api/v1/labs/{lab}/disks",
            [401, MISSING, MISSING, FORBIDDEN, OK, OK],
        ),
        (
            "api_attach",
            "post",
            f"/api/v1/labs/{lab}/disks/{disk.pk}/attach",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        (
            "api_detach",
            "post",
            f"/api/v1/labs/{lab}/disks/{disk.pk}/detach",
            [401, MISSING, MISSING, FORBIDDEN, 400, 400],
        ),
        # Jobs: the member ran the job; no one here has active access to run another.
        (
            "lab_usage",
            "get",
            reverse("lab_usage", args=[lab]),
            [REDIRECT, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "lab_usage_csv",
            "get",
            reverse("lab_usage_csv", args=[lab]),
            [REDIRECT, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "vm_jobs",
            "get",
            reverse("vm_jobs", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "job_submit",
            "get",
            reverse("job_submit", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "job_submit_post",
            "post",
            reverse("job_submit", args=[lab, vm.pk]),
            [REDIRECT, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        ("job_detail", "get", f"/{jobs}/", [REDIRECT, MISSING, MISSING, OK, OK, OK]),
        ("job_live", "get", f"/{jobs}/live/", [REDIRECT, MISSING, MISSING, OK, OK, OK]),
        # The worker's address is outside the allowed networks: it cannot give the log.
        ("job_log", "get", f"/{jobs}/workers/0/log", [REDIRECT, MISSING, MISSING, 502, 502, 502]),
        # Ended: nothing to cancel, said in a message.
        (
            "job_cancel",
            "post",
            f"/{jobs}/cancel/",
            [REDIRECT, MISSING, MISSING, REDIRECT, REDIRECT, REDIRECT],
        ),
        # The owner is told why not in a message; the admins may not run someone's job.
        (
            "job_rerun",
            "post",
            f"/{jobs}/rerun/",
            [REDIRECT, MISSING, MISSING, REDIRECT, FORBIDDEN, FORBIDDEN],
        ),
        (
            "api_jobs",
            "get",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/jobs",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_job_submit",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/jobs",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        (
            "api_job_validate",
            "post",
            f"/api/v1/labs/{lab}/vms/{vm.pk}/jobs/validate",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        ("api_job", "get", f"/api/v1/{jobs}", [401, MISSING, MISSING, OK, OK, OK]),
        # Only the person who submitted it finds it by its id alone.
        (
            "api_my_job",
            "get",
            f"/api/v1/me/jobs/{job.pk}",
            [401, MISSING, MISSING, OK, MISSING, MISSING],
        ),
        (
            "api_job_cancel",
            "post",
            f"/api/v1/{jobs}/cancel",
            [401, MISSING, MISSING, 409, 409, 409],
        ),
        (
            "api_job_rerun",
            "post",
            f"/api/v1/{jobs}/rerun",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        (
            "api_job_log",
            "get",
            f"/api/v1/{jobs}/workers/0/log",
            [401, MISSING, MISSING, 502, 502, 502],
        ),
        # The pool: a job of the lab by its id alone; one placed (or named for its VM)
        # is its VM's job page.
        (
            "lab_job",
            "get",
            reverse("lab_job", args=[lab, job.pk]),
            [REDIRECT, MISSING, MISSING, REDIRECT, REDIRECT, REDIRECT],
        ),
        (
            "lab_job_cancel",
            "post",
            reverse("lab_job_cancel", args=[lab, job.pk]),
            [REDIRECT, MISSING, MISSING, REDIRECT, REDIRECT, REDIRECT],
        ),
        ("api_pool_jobs", "get", f"/api/v1/labs/{lab}/jobs", [401, MISSING, MISSING, OK, OK, OK]),
        # Workdir snapshots: each member's own (the blob is the JSON body "{}").
        (
            "api_snapshot_missing",
            "post",
            f"/api/v1/labs/{lab}/snapshots/missing",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_snapshot_blob",
            "put",
            f"/api/v1/labs/{lab}/snapshots/blobs/{_EMPTY_JSON_SHA}",
            [401, MISSING, MISSING, 201, 201, 201],
        ),
        (
            "api_snapshot_blobs",
            "post",
            f"/api/v1/labs/{lab}/snapshots/blobs",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_snapshot_create",
            "post",
            f"/api/v1/labs/{lab}/snapshots",
            [401, MISSING, MISSING, 201, 201, 201],
        ),
        # No one here has active access to a v4-8 of the lab.
        (
            "api_pool_job_submit",
            "post",
            f"/api/v1/labs/{lab}/jobs",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        (
            "api_pool_job_validate",
            "post",
            f"/api/v1/labs/{lab}/jobs/validate",
            [401, MISSING, MISSING, FORBIDDEN, FORBIDDEN, FORBIDDEN],
        ),
        (
            "api_lab_job",
            "get",
            f"/api/v1/labs/{lab}/jobs/{job.pk}",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_lab_job_cancel",
            "post",
            f"/api/v1/labs/{lab}/jobs/{job.pk}/cancel",
            [401, MISSING, MISSING, 409, 409, 409],
        ),
        ("api_usage", "get", f"/api/v1/labs/{lab}/usage", [401, MISSING, MISSING, OK, OK, OK]),
        (
            "api_usage_people",
            "get",
            f"/api/v1/labs/{lab}/usage/people",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_usage_vms",
            "get",
            f"/api/v1/labs/{lab}/usage/vms",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
        (
            "api_usage_now",
            "get",
            f"/api/v1/labs/{lab}/usage/now",
            [401, MISSING, MISSING, OK, OK, OK],
        ),
    ]


def _ended_job(vm, user):
    from django.utils import timezone

    from tpus.models import Job, JobWorker

    now = timezone.now()
    job = Job.objects.create(
        vm=vm, user=user, host_id="20260101-matrix", state="succeeded", args=["true"],
        started_at=now, ended_at=now,
    )  # fmt: skip
    JobWorker.objects.create(job=job, worker=vm.workers.get(index=0), index=0, state="ended")
    return job


def _user(cast, role):
    return None if role == "anonymous" else getattr(cast, role)


@pytest.mark.parametrize("role_index", range(len(ROLES)), ids=ROLES)
def test_every_url_answers_each_kind_of_visitor_as_expected(client, cast, role_index):
    role = ROLES[role_index]
    user = _user(cast, role)
    failures = []
    rows = _urls(cast)
    vm_id = TpuVm.objects.get(lab=cast.lab, name="tpu5").pk
    for name, method, url, expected in rows:
        if user is not None:
            client.force_login(user)
        else:
            client.logout()
        if url.startswith("/api/") and method in {"post", "put", "patch"}:
            body = {
                "api_join": {"purpose": "Research.", "accept_policy": True},
                "api_member_role": {"role": "admin"},
                "api_member_share_set": {"share": "2"},
                "api_lab_settings_update": {"discoverable": True},
                "api_lab_settings_project": {"gcp_project_id": "moved-project"},
                "api_lab_settings_grant_end": {"grant_end_date": "2099-12-31"},
                "api_disk_register": {"name": "matrix-disk", "zone": "us-central1-f"},
                # No zones: refused with what is missing.
                "api_elastic_pool_set": {"enabled": True},
                "api_vm_register": {
                    "name": "tpu10",
                    "zone": "us-central1-f",
                    "accelerator_type": "v3-8",
                    "workers": [{"external_ip": "192.0.2.98"}],
                },
                "api_token_create": {"name": "matrix"},
                "api_device_codes": {"device_name": "matrix"},
                "api_vm_request_create": {
                    "name": "tpu8",
                    "zone": "us-central1-f",
                    "accelerator_type": "v4-8",
                    "runtime_version": "tpu-ubuntu2204-base",
                },
                "api_allowance_set": {"generation": "v4", "provisioning": "spot", "chips": 8},
                "api_vm_delete": {"name": "tpu5"},
                "api_device_token": {"device_code": "unknown"},
                "api_lab_create": {
                    "name": "Matrix Lab",
                    "slug": "matrix",
                    "gcp_project_id": "matrix-project",
                    "zones": ["us-central1-f"],
                    "admin_emails": ["admin@vision.example"],
                },
                "api_import": {"nodes": ["us-central1-f/tpu9"]},
                "api_grant_create": {"user_email": "nobody@example.org", "vm_ids": [vm_id]},
                "api_kind_grant_create": {
                    "user_email": "nobody@example.org",
                    "accelerator_type": "v4-8",
                },
                "api_attach": {"vm_id": vm_id},
                "api_detach": {"vm_id": vm_id},
                "api_key_add": {"key": ECDSA_256, "label": "matrix"},
                "api_unix_account_set": {"username": "matrix"},
                "api_worker_keys_pin": {"shown": "forged"},
                "api_job_submit": {"args": ["true"]},
                "api_job_validate": {"args": ["true"]},
                "api_pool_job_submit": {"args": ["true"], "accelerator_type": "v4-8"},
                "api_pool_job_validate": {"args": ["true"], "accelerator_type": "v4-8"},
                "api_snapshot_missing": {"files": [_SNAPSHOT_FILE]},
                "api_snapshot_create": {"files": [_SNAPSHOT_FILE]},
                # One content in the bundle's framing: its sha256 and size, then "{}".
                "api_snapshot_blobs": f"{_EMPTY_JSON_SHA} 2\n{{}}",
            }.get(name, {})
            response = getattr(client, method)(url, body, content_type="application/json")
        else:
            data = {
                "lab_settings_project": {"gcp_project_id": "another-project"},
                "lab_settings_grant_end": {"grant_end_date": "2099-12-31"},
                "vm_register_post": {
                    "name": "tpu9",
                    "zone": "us-central1-f",
                    "accelerator_type": "v3-8",
                    "workers": "192.0.2.99",
                },
                "worker_keys_pin": {"shown": "forged"},
                "worker_keys_resume": {"action": "resume"},
                "worker_keys_scan_start": {"action": "scan"},
                "job_submit_post": {"command": "true"},
            }.get(name)
            response = getattr(client, method)(url, data) if data else getattr(client, method)(url)
        if response.status_code != expected[role_index]:
            failures.append(
                f"{name} {url}: {response.status_code}, expected {expected[role_index]}"
            )
        # Each state-changing request runs against a fresh cast: undo by reloading below.
        cast.pending_membership.refresh_from_db()
    # Only a site admin's requests may have moved the lab or registered a VM.
    cast.lab.refresh_from_db()
    assert cast.lab.gcp_project_id != "another-project"
    assert TpuVm.objects.filter(name="tpu9").exists() == (role == "site_admin")
    assert TpuVm.objects.filter(name="tpu10").exists() == (role == "site_admin")
    moved = cast.lab.gcp_project_id == "moved-project"
    assert moved == (role == "site_admin")
    assert not Worker.objects.filter(vm__name="tpu5").exclude(host_keys=[]).exists()
    assert HostKeyScan.objects.exists() == (role in {"admin", "site_admin"})
    assert not failures, f"{role}:\n" + "\n".join(failures)


def test_another_labs_membership_is_a_404_even_for_an_admin(client, cast):
    client.force_login(cast.admin)
    url = reverse("membership_approve", args=[cast.lab.slug, cast.other_membership.pk])
    assert client.post(url).status_code == 404
    cast.other_membership.refresh_from_db()
    assert cast.other_membership.state == "requested"


def test_an_admin_of_another_lab_cannot_reach_this_lab_by_its_slug(client, cast):
    client.force_login(cast.outsider)
    for url in (
        reverse("lab_admin", args=[cast.lab.slug]),
        reverse("membership_approve", args=[cast.lab.slug, cast.pending_membership.pk]),
        f"/api/v1/labs/{cast.lab.slug}/memberships",
    ):
        response = client.post(url) if "approve" in url else client.get(url)
        assert response.status_code == 404, url
    cast.pending_membership.refresh_from_db()
    assert cast.pending_membership.state == "requested"


def test_a_missing_lab_and_a_hidden_lab_look_the_same(client, cast):
    client.force_login(cast.outsider)
    hidden = client.get(reverse("lab_detail", args=[cast.lab.slug]))
    missing = client.get(reverse("lab_detail", args=["no-such-lab"]))
    assert hidden.status_code == missing.status_code == 404
    # Byte for byte, but for the CSRF token every page carries (masked anew each time).
    token = re.compile(rb'(csrfmiddlewaretoken" value="|X-CSRFToken": ")[^"]+')
    assert token.sub(rb"\1", hidden.content) == token.sub(rb"\1", missing.content)
    assert hidden.content.count(b"X-CSRFToken") == 1


def test_someone_elses_api_token_is_a_404(client, cast):
    from accounts.services import create_token

    token, _ = create_token(cast.member, "laptop")
    client.force_login(cast.outsider)
    assert client.post(reverse("token_revoke", args=[token.pk])).status_code == 404
    token.refresh_from_db()
    assert token.revoked_at is None


def test_the_matrix_covers_every_page_of_the_portal(cast):
    """A new URL must be added to the matrix above before it can ship."""
    from django.urls import get_resolver

    from portal.api import api

    rows = _urls(cast)
    covered = {name for name, *_ in rows}
    names = set()
    for pattern in get_resolver().url_patterns:
        module = getattr(pattern, "urlconf_module", None)
        if getattr(module, "__name__", "") in {"tpus.urls", "accounts.urls"}:
            names |= {p.name for p in module.urlpatterns}
    missing = names - covered
    assert not missing, f"pages missing from the authorization matrix: {sorted(missing)}"
    covered_api = [(method, url) for name, method, url, _ in rows if name.startswith("api_")]
    uncovered = []
    for template, operations in api.get_openapi_schema()["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$")
        for method in operations:
            if not any(m == method and pattern.match(url) for m, url in covered_api):
                uncovered.append(f"{method.upper()} {template}")
    assert not uncovered, f"API operations missing from the matrix: {uncovered}"

"""A kind grant on real hosts: the person given every v4-32 of the lab gets an account
on each worker of a v4-32 the portal makes for the lab afterwards."""

from __future__ import annotations

import subprocess

import pytest

from accounts.keys import add_key
from accounts.unix import choose_username
from tpus.models import TpuVm
from tpus.services import reconcile, vm_request_work, vm_requests
from tpus.services.kind_grants import grant_kind
from tpus.tests.test_created_vms_fleet import _connected, _spot_pod
from tpus.tests.test_created_vms_fleet import scene as scene  # a fixture

pytestmark = pytest.mark.fleet


def test_a_vm_made_after_the_kind_grant_gives_the_person_an_account_on_every_worker(
    scene, cast, tpu_emulator, fleet, fleet_username, fleet_uids, tmp_path,
    django_capture_on_commit_callbacks,
):  # fmt: skip
    lab, hosts = scene
    key = tmp_path / "id_milo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    choose_username(cast.member, fleet_username)
    add_key(cast.member, key.with_suffix(".pub").read_text().strip())
    kind = grant_kind(cast.admin, lab, cast.member, "v4-32", sudo=False)

    made = vm_requests.request_vm(cast.admin, lab, _spot_pod())
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    assert _connected(vm).state == "connected"
    [grant] = vm.grants.all()
    assert grant.from_kind_id == kind.pk
    with django_capture_on_commit_callbacks(execute=True):
        reconcile.reconcile_vm(vm.pk)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    for host in hosts:
        out = fleet.exec(host.name, ["id", "-un", fleet_username]).stdout.decode().strip()
        assert out == fleet_username

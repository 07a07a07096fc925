"""The tenant boundary on the hosts themselves: the portal logs in to a lab's workers
only with that lab's key, so rows that point lab A at lab B's worker (however they got
into the database) cannot change that worker."""

from __future__ import annotations

import pytest

from accounts.keys import add_key
from accounts.models import User
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tpus.models import Grant, TpuVm, Worker
from tpus.models.inventory import HostKeySource, VmSource
from tpus.services import inventory
from tpus.services.grants import grant_access

pytestmark = pytest.mark.fleet
ZONE = "us-central1-f"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGmq8Ajnn7qAVXoI9/9HUd9WQnXOJk4aOuq2SPeVvJGh"


def _state_of(fleet, host) -> str:
    """What a host's accounts, sudo rules and portal key files look like."""
    return fleet.exec(
        host.name,
        ["sh", "-c", "cat /etc/passwd /etc/group; ls -la /etc/sudoers.d /etc/ssh/tpu-portal-keys"
         " 2>&1; cat /etc/ssh/tpu-portal-keys/* 2>/dev/null"],
    ).stdout.decode()  # fmt: skip


def _person(make_user, add_member, lab, username, email):
    person = make_user(email)
    add_member(lab, person)
    choose_username(person, username)
    add_key(person, KEY if "b-" in email else KEY.replace("AAAAIGmq", "AAAAIHmq"))
    return User.objects.get(pk=person.pk)  # with the username just chosen


@pytest.fixture
def two_labs(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids,
    make_lab, make_user, add_member,
):  # fmt: skip
    host_a, host_b = fleet_hosts(2)
    lab_a = make_lab("Lab A", slug="lab-a", gcp_project_id="project-a", zones=[ZONE])
    lab_b = make_lab("Lab B", slug="lab-b", gcp_project_id="project-b", zones=[ZONE])
    admin_a, admin_b = make_user("boss@a.example"), make_user("boss@b.example")
    add_member(lab_a, admin_a, role="admin")
    add_member(lab_b, admin_b, role="admin")
    # Each lab's key reaches only its own host.
    give_lab_key(fleet, [host_a], lab_a)
    give_lab_key(fleet, [host_b], lab_b)
    add_fleet_node(tpu_emulator.controls, fleet, [host_b], "project-b", ZONE, "tpu-b")
    [vm_b] = inventory.import_vms(admin_b, lab_b, [f"{ZONE}/tpu-b"])
    return {
        "host_a": host_a, "host_b": host_b, "lab_a": lab_a, "lab_b": lab_b,
        "admin_a": admin_a, "admin_b": admin_b, "vm_b": vm_b, "name": fleet_username,
    }  # fmt: skip


def test_rows_pointing_lab_a_at_lab_bs_worker_cannot_change_it(
    two_labs, fleet, make_user, add_member, django_capture_on_commit_callbacks
):
    s = two_labs
    # Lab B works: its member is provisioned on its own worker with its own key.
    bob = _person(make_user, add_member, s["lab_b"], s["name"] + "b", "bob@b-lab.example")
    with django_capture_on_commit_callbacks(execute=True):
        [grant_b] = grant_access(s["admin_b"], s["lab_b"], bob, [s["vm_b"]], sudo=False)
    grant_b.refresh_from_db()
    assert grant_b.state == "active", grant_b.error
    before = _state_of(fleet, s["host_b"])

    # Lab A's rows, written straight to the database, point at lab B's worker with its
    # real pinned host key: no page or API check stands in the way here.
    vm_a = TpuVm.objects.create(
        lab=s["lab_a"], name="stolen", zone=ZONE, source=VmSource.MANUAL, accelerator_type="v4-8"
    )
    Worker.objects.create(
        vm=vm_a, index=0, external_ip=s["host_b"].ip,
        host_keys=fleet.host_keys(s["host_b"].name),
        host_keys_source=HostKeySource.ADMIN,
    )  # fmt: skip
    mallory = _person(make_user, add_member, s["lab_a"], s["name"] + "m", "mallory@a.example")
    with django_capture_on_commit_callbacks(execute=True):
        [grant_a] = grant_access(s["admin_a"], s["lab_a"], mallory, [vm_a], sudo=True)
    grant_a.refresh_from_db()

    assert grant_a.state == "failed"
    assert "does not accept the lab's key" in grant_a.error
    assert _state_of(fleet, s["host_b"]) == before
    assert s["name"] + "m" not in before
    # Lab B's own access is untouched and still works.
    assert Grant.objects.get(pk=grant_b.pk).state == "active"


def test_the_same_grant_on_lab_as_own_worker_works(
    two_labs, fleet, make_user, add_member, tpu_emulator, django_capture_on_commit_callbacks
):
    s = two_labs
    add_fleet_node(tpu_emulator.controls, fleet, [s["host_a"]], "project-a", ZONE, "tpu-a")
    [vm_a] = inventory.import_vms(s["admin_a"], s["lab_a"], [f"{ZONE}/tpu-a"])
    alice = _person(make_user, add_member, s["lab_a"], s["name"] + "a", "alice@a.example")
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(s["admin_a"], s["lab_a"], alice, [vm_a], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    assert f"{s['name']}a:" in _state_of(fleet, s["host_a"])

"""``demo_lab`` (what ``bin/demo`` runs before the portal starts) on the sshd fleet and
the emulator: tpu5's workers answer on their internal addresses, everyone given
access finds ``~/venv``, and running it again on the fleet ``bin/demo`` kept changes
no pin, while a fleet built anew is re-pinned and the output says so."""

from __future__ import annotations

import os

import pytest

from tpus.management.commands.demo_lab import set_up_demo
from tpus.models import TpuVm

pytestmark = [pytest.mark.fleet, pytest.mark.django_db]


@pytest.fixture
def demo(fleet, tpu_emulator, fleet_settings, make_user):
    make_user("root@demo.example", is_superuser=True, is_staff=True)
    hosts = sorted(fleet.hosts.values(), key=lambda h: h.index)[:4]
    for host in hosts:
        fleet.heal(host.name)
    return fleet, tpu_emulator.controls, hosts


def _pins(vm) -> dict[int, list[str]]:
    return {w.index: sorted(w.host_keys) for w in vm.workers.order_by("index")}


def _published(controls, index: int) -> list[str]:
    [node] = [n for name, n in controls.show()["nodes"].items() if name.endswith("/tpu5")]
    return sorted(node["workers"][index]["host_keys"].values())


def test_the_workers_answer_on_their_internal_addresses_and_homes_get_a_jax_venv(demo):
    fleet, controls, hosts = demo
    printed = set_up_demo(fleet, controls)
    vm = TpuVm.objects.get(name="tpu5")
    assert [(w.internal_ip, w.external_ip) for w in vm.workers.order_by("index")] == [
        (h.ip, h.ip) for h in hosts
    ]
    jax_env = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
    for host in hosts:
        link = fleet.exec(host.name, ["readlink", "/etc/skel/venv"]).stdout.decode().strip()
        assert link == jax_env
        # A home made now (as the reconcile's useradd -m makes them) has the link.
        fleet.exec(host.name, ["useradd", "-m", "-u", "41777", "demo-venv-check"])
        try:
            made = fleet.exec(host.name, ["readlink", "/home/demo-venv-check/venv"])
            assert made.stdout.decode().strip() == jax_env
        finally:
            fleet.exec(host.name, ["userdel", "-r", "demo-venv-check"], check=False)
    assert "4. Run a job: as milo" in printed
    assert "re-pinned" not in printed


def test_running_it_again_on_the_kept_fleet_changes_no_pin_and_mends_made_up_addresses(demo):
    fleet, controls, hosts = demo
    set_up_demo(fleet, controls)
    vm = TpuVm.objects.get(name="tpu5")
    pins = _pins(vm)
    # An earlier demo made tpu5's internal addresses up; the fleet answers on its own.
    controls.set_ip("tpu5", 0, "10.128.0.2", internal=True)

    printed = set_up_demo(fleet, controls)

    assert _pins(vm) == pins
    assert pins[0] == sorted(fleet.host_keys(hosts[0].name))
    assert vm.workers.get(index=0).internal_ip == hosts[0].ip
    assert "re-pinned" not in printed and "4. Run a job" in printed


def test_a_fleet_built_anew_is_re_pinned_and_the_output_says_why(demo):
    fleet, controls, hosts = demo
    set_up_demo(fleet, controls)
    vm = TpuVm.objects.get(name="tpu5")
    before = _pins(vm)
    new_keys = sorted(fleet.rekey(hosts[1].name))  # as when the machine restarted

    printed = set_up_demo(fleet, controls)

    after = _pins(vm)
    assert after[1] == new_keys != before[1]
    assert {i: after[i] for i in (0, 2, 3)} == {i: before[i] for i in (0, 2, 3)}
    assert _published(controls, 1) == new_keys
    assert "the test fleet was built anew" in printed
    assert "new host keys), so tpu5-w1 was re-pinned to them" in printed
    assert "download known_hosts again" in printed

"""pytest fixtures for the sshd fleet; the root conftest loads them with
``pytest_plugins = ["testfleet.fixtures"]``.

- ``fleet`` (session): a running Fleet of ``TESTFLEET_HOSTS`` hosts (default 8). Each
  pytest process (each xdist worker) claims its own slot, so its own subnet, names and
  state dir; the slot's leftovers from a crashed run are removed first, and everything
  is removed at the end of the session.
- ``fleet_host``: one healthy host (round robin), healed again after the test, so a
  test may reboot, move, take down or rekey it (a host it took down also has its SSH
  connections ended then: nothing sent to it while it was cut off reaches a later
  test).
- ``fleet_hosts``: ``fleet_hosts(n)`` gives n distinct healthy hosts, healed after.
- ``fleet_username``: a fresh unix user name for this test (hosts are shared between
  the tests of a session, so tests never reuse a name).
- ``fleet_settings``: Django settings pointing the remote door at the fleet.

Without root, network namespaces, overlayfs or openssh-server these fixtures skip the
test with the reason, and fail it when ``CI`` is set.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import shutil
import subprocess

import pytest

from testfleet.fleet import Fleet, Host
from tests.requirements import need

_usernames = itertools.count(1)
_uid_blocks = itertools.count(0)
_round_robin = itertools.count()


def _fleet_support_problem() -> str | None:
    if os.geteuid() != 0:
        return "the sshd test fleet needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"the sshd test fleet needs {tool} (iproute2, util-linux)"
    for path, package in (("/usr/sbin/sshd", "openssh-server"), ("/usr/bin/sudo", "sudo")):
        if not os.path.exists(path):
            return f"the sshd test fleet needs Debian's {package}"
    with open("/proc/filesystems") as handle:
        if "overlay" not in handle.read():
            subprocess.run(["modprobe", "overlay"], capture_output=True, check=False)
            with open("/proc/filesystems") as again:
                if "overlay" not in again.read():
                    return "the sshd test fleet needs overlayfs"
    return None


def _first_slot() -> int:
    match = re.search(r"\d+", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return 1 + int(match.group()) if match else 1


@pytest.fixture(scope="session")
def fleet():
    problem = _fleet_support_problem()
    need(problem is None, problem or "")
    fleet = Fleet.open_free(first=_first_slot())
    try:
        fleet.teardown()  # whatever a crashed run left in this slot
        fleet.up(int(os.environ.get("TESTFLEET_HOSTS", "8")))
        yield fleet
    finally:
        fleet.destroy()


@pytest.fixture
def fleet_hosts(fleet):
    """A function: ``fleet_hosts(n)`` → n distinct healthy hosts."""
    handed: list[Host] = []
    hosts = list(fleet.hosts.values())

    def take(count: int) -> list[Host]:
        if count > len(hosts):
            pytest.fail(f"the fleet has {len(hosts)} hosts; set TESTFLEET_HOSTS >= {count}")
        start = next(_round_robin)
        chosen = [hosts[(start + i) % len(hosts)] for i in range(count)]
        for host in chosen:
            fleet.heal(host.name)
        handed.extend(chosen)
        return chosen

    yield take
    for host in handed:
        fleet.heal(host.name)


@pytest.fixture
def fleet_host(fleet_hosts) -> Host:
    return fleet_hosts(1)[0]


@pytest.fixture
def fleet_username() -> str:
    """A unix user name no other test of any session uses."""
    return f"ft{next(_usernames)}x{secrets.token_hex(3)}"


@pytest.fixture
def fleet_uids(settings) -> tuple[int, int]:
    """A block of 20 UIDs of the portal's default range that no other test of this
    session uses (the fleet's hosts outlive each test's database), set as the portal's
    range for this test."""
    from portal.idranges import DEFAULT_MAX, DEFAULT_MIN

    first = DEFAULT_MIN + next(_uid_blocks) * 20
    if first + 19 > DEFAULT_MAX:
        pytest.fail("this session used up the UID blocks of the portal's default range")
    settings.PORTAL_UID_MIN, settings.PORTAL_UID_MAX = first, first + 19
    return first, first + 19


@pytest.fixture
def fleet_settings(settings, fleet):
    """Django settings that point tpus.remote at the fleet's admin key and account."""
    settings.PORTAL_ADMIN_SSH_KEY_FILE = str(fleet.admin_key_path)
    settings.PORTAL_ADMIN_SSH_KEY = ""
    settings.PORTAL_ADMIN_SSH_USER = fleet.admin_user
    settings.PORTAL_REMOTE_CONNECT_TIMEOUT = 5
    settings.PORTAL_REMOTE_AUTH_TIMEOUT = 10
    settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 60
    settings.PORTAL_REMOTE_DRY_RUN = False
    return settings


def add_fleet_node(controls, fleet, hosts, project: str, zone: str, name: str) -> None:
    """An emulated TPU VM whose workers are ``hosts``: their addresses as the workers'
    internal and external IPs and their host keys in guest attributes, as Google publishes them."""
    controls.add_node(
        project, zone, name, accelerator_type=f"v4-{8 * len(hosts)}", workers=len(hosts),
        # A fleet host has one address: the workers reach each other (a pod's
        # coordinator) and the portal reaches them at it.
        internal_ips=[h.ip for h in hosts], external_ips=[h.ip for h in hosts],
        host_keys={
            i: {line.split()[0]: line for line in fleet.host_keys(h.name)}
            for i, h in enumerate(hosts)
        },
    )  # fmt: skip


def give_lab_key(fleet, hosts, lab) -> None:
    """Put the lab's public key on ``hosts`` for the portal's account, as connecting
    the VM through its ``ssh-keys`` metadata does on a real TPU VM (Google's guest
    agent creates the account with sudo). Hosts not listed never get it."""
    from django.conf import settings

    from tpus.services.labkeys import lab_key

    line = lab_key(lab).public_line
    for host in hosts:
        fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [line]})


@pytest.fixture
def guest_agent(fleet, tpu_emulator):
    """Google's guest agent on the fleet: applies the emulator's node metadata
    ``ssh-keys`` to the nodes' hosts every 0.2 s while the test runs."""
    from testfleet.guestagent import GuestAgent

    agent = GuestAgent(fleet, tpu_emulator.state_file, interval=0.2).start()
    try:
        yield agent
    finally:
        agent.stop()

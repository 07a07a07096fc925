"""pytest fixtures for the sshd fleet; the root conftest loads them with
``pytest_plugins = ["testfleet.fixtures"]``.

- ``fleet`` (session): a running Fleet of ``TESTFLEET_HOSTS`` hosts (default 8). Each
  pytest process (each xdist worker) claims its own slot, so its own subnet, names and
  state dir; the slot's leftovers from a crashed run are removed first, and everything
  is removed at the end of the session.
- ``fleet_host``: one healthy host (round robin), healed again after the test, so a
  test may reboot, move, take down or rekey it.
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
    external IPs and their host keys in guest attributes, as Google publishes them."""
    controls.add_node(
        project, zone, name, accelerator_type=f"v4-{8 * len(hosts)}", workers=len(hosts),
        external_ips=[h.ip for h in hosts],
        host_keys={
            i: {line.split()[0]: line for line in fleet.host_keys(h.name)}
            for i, h in enumerate(hosts)
        },
    )  # fmt: skip

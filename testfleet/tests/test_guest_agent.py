"""The guest-agent stand-in: a node's ``ssh-keys`` metadata becomes accounts with
passwordless sudo and exactly the listed keys on that node's fleet hosts, and
``enable-oslogin`` turns that off, as Google's guest agent does on a TPU VM."""

from __future__ import annotations

import subprocess
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from testfleet.fixtures import add_fleet_node
from testfleet.guestagent import apply_once, key_lines
from tpus.emulator.controls import Controls

pytestmark = pytest.mark.fleet
PROJECT = "lab-project"
ZONE = "us-central2-b"


def key_pair(directory, name: str) -> tuple[str, str]:
    """A fresh ed25519 key: (private key file, public "ssh-ed25519 AAAA… comment")."""
    private = ed25519.Ed25519PrivateKey.generate()
    path = directory / name
    path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    public = private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return str(path), f"{public.decode()} {name}@test"


def ssh_as(fleet, host, user: str, key_file: str, command: str = "sudo -n id -u"):
    known = fleet.state_dir / f"known_hosts-agent-{host.name}"
    known.write_text("".join(f"{host.ip} {key}\n" for key in fleet.host_keys(host.name)))
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", key_file, "-o", "BatchMode=yes",
         "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
         "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
         f"{user}@{host.ip}", command],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip


@pytest.fixture
def scene(tmp_path, fleet, fleet_hosts, fleet_username):
    controls = Controls(tmp_path / "emulator.json")
    hosts = fleet_hosts(2)
    add_fleet_node(controls, fleet, hosts, PROJECT, ZONE, "tpu1")
    key_file, public = key_pair(tmp_path, "portal")
    return controls, hosts, fleet_username, key_file, public


def test_a_listed_key_opens_every_worker_with_passwordless_sudo(fleet, scene):
    controls, hosts, user, key_file, public = scene
    controls.set_metadata("tpu1", {"ssh-keys": f"other:ssh-ed25519 AAAAC3Nz x\n{user}:{public}"})

    done = apply_once(fleet, controls.show())

    for host in hosts:
        assert done.hosts[host.name][user] == 1
        result = ssh_as(fleet, host, user, key_file)
        assert (result.returncode, result.stdout.strip()) == (0, "0"), result.stderr
        listing = fleet.exec(
            host.name,
            ["stat", "-c", "%U %a", f"/home/{user}/.ssh", f"/home/{user}/.ssh/authorized_keys"],
        )
        assert listing.stdout.decode().split("\n")[:2] == [f"{user} 700", f"{user} 600"]
        keys = fleet.exec(host.name, ["cat", f"/home/{user}/.ssh/authorized_keys"])
        assert keys.stdout.decode() == public + "\n"


def test_a_removed_line_takes_the_keys_away_but_leaves_the_account(fleet, scene):
    controls, hosts, user, key_file, public = scene
    controls.set_metadata("tpu1", {"ssh-keys": f"{user}:{public}"})
    apply_once(fleet, controls.show())

    controls.set_metadata("tpu1", {"ssh-keys": None})
    done = apply_once(fleet, controls.show())

    assert done.hosts[hosts[0].name] == {}
    assert ssh_as(fleet, hosts[0], user, key_file).returncode == 255
    assert fleet.exec(hosts[0].name, ["id", "-u", user], check=False).returncode == 0


@pytest.mark.parametrize("where", ["project", "node"])
def test_os_login_makes_the_agent_ignore_ssh_keys(fleet, scene, where):
    controls, hosts, user, key_file, public = scene
    controls.set_metadata("tpu1", {"ssh-keys": f"{user}:{public}"})
    apply_once(fleet, controls.show())
    assert ssh_as(fleet, hosts[0], user, key_file).returncode == 0

    if where == "project":
        controls.set_oslogin(PROJECT, True)
    else:
        controls.set_metadata("tpu1", {"enable-oslogin": "TRUE"})
    apply_once(fleet, controls.show())

    assert ssh_as(fleet, hosts[0], user, key_file).returncode == 255


def test_hosts_of_no_node_are_left_alone(fleet, fleet_hosts, tmp_path, fleet_username):
    controls = Controls(tmp_path / "emulator.json")
    host = fleet_hosts(1)[0]
    controls.add_node(PROJECT, ZONE, "elsewhere", metadata={"ssh-keys": "x:ssh-ed25519 AAAA x"})

    done = apply_once(fleet, controls.show())

    assert host.name not in done.hosts


def test_lines_the_agent_cannot_use_are_skipped():
    value = (
        "good:ssh-ed25519 AAAA c\n"
        "Bad Name:ssh-ed25519 AAAA c\n"
        "nokey:\n"
        "odd:ssh-dss AAAA c\n"
        "  spaced:ssh-rsa BBBB  two  words \r"
    )
    assert key_lines(value) == [
        ("good", "ssh-ed25519 AAAA c"),
        ("spaced", "ssh-rsa BBBB two words"),
    ]


def test_the_agent_fixture_follows_metadata_changes(fleet, fleet_hosts, tpu_emulator, guest_agent,
                                                    fleet_username, tmp_path):  # fmt: skip
    host = fleet_hosts(1)[0]
    add_fleet_node(tpu_emulator.controls, fleet, [host], PROJECT, ZONE, "tpu1")
    key_file, public = key_pair(tmp_path, "agent")

    tpu_emulator.controls.set_metadata("tpu1", {"ssh-keys": f"{fleet_username}:{public}"})

    deadline = time.monotonic() + 15
    while ssh_as(fleet, host, fleet_username, key_file).returncode != 0:
        assert time.monotonic() < deadline, "the agent never applied the key"
        time.sleep(0.3)

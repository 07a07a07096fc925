"""Host key pins and the fixed command line, without any host."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from tpus.remote import HostKeyPins, InvalidHostKey, scripts
from tpus.remote.ssh import command_for


def public(key) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


# Fixed keys: test ids must be the same in every xdist worker.
ED = public(ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
EC = public(ec.derive_private_key(20240601, ec.SECP256R1()))


def test_pins_are_canonical_ordered_and_lose_comments():
    pins = HostKeyPins.parse([EC + " root@tpu5", ED, ED + " again"])
    assert pins.keys == (ED, EC)
    assert [k.get_name() for k in pins.paramiko_keys()] == ["ssh-ed25519", "ecdsa-sha2-nistp256"]


def test_pins_parse_a_block_of_lines():
    assert HostKeyPins.parse(f"{ED}\n\n{EC}\n").keys == (ED, EC)


@pytest.mark.parametrize(
    "line",
    [
        "ssh-dss AAAAB3NzaC1kc3MAAACBAP",
        f'command="sh" {ED}',
        ED.replace("ssh-ed25519", "ssh-rsa"),
        ED[:-8],
        ED + "\nssh-ed25519 AAAA",
        "ssh-ed25519 !!!notbase64",
        "ssh-ed25519",
        "ssh-ed25519 " + base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519").decode(),
    ],
)
def test_malformed_or_unaccepted_host_keys_are_refused(line):
    with pytest.raises(InvalidHostKey):
        HostKeyPins.parse([line])


def test_no_pins_is_false():
    assert not HostKeyPins()


def test_the_command_line_is_a_constant_that_carries_no_data():
    command = command_for(scripts.load("whoami.sh"))
    assert command == (
        'sudo -n -- /bin/sh -c \'set -eu; read -r tpu_n; tpu_s=$(head -c "$tpu_n"); '
        'eval "$tpu_s"\' whoami.sh'
    )


@pytest.mark.parametrize("name", ["../etc/passwd", "whoami", "Whoami.sh", "a b.sh", "-x.sh"])
def test_only_scripts_of_the_scripts_folder_can_be_named(name):
    with pytest.raises(ValueError):
        scripts.load(name)

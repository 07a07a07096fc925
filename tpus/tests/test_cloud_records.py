"""Host keys from guest attributes become known_hosts lines, or nothing."""

from __future__ import annotations

import pytest

from tpus.cloud import DiskInfo, host_key_line

# A fixed public key, so parametrized test ids are the same in every xdist worker.
KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIAOhB7/zzhC+HXDdGOdLwJln5NYwm6UNXx3chmQSVTG4"


def test_a_bare_base64_key_gets_its_type_in_front():
    assert host_key_line("ssh-ed25519", KEY) == f"ssh-ed25519 {KEY}"


def test_a_whole_line_loses_its_comment():
    assert host_key_line("ssh-ed25519", f"ssh-ed25519 {KEY} root@t1v-n-1\n") == f"ssh-ed25519 {KEY}"


@pytest.mark.parametrize(
    ("key_type", "value"),
    [
        ("ssh-rsa", KEY),  # the blob says ed25519
        ("ssh-ed25519", f"ssh-rsa {KEY}"),  # the line names another type
        ("ssh-ed25519", "not base64!"),
        ("ssh-ed25519", "AAAA"),  # too short to hold a type
        ("ssh-dss", "AAAAB3NzaC1kc3M="),  # not a type the portal pins
        ("ssh-ed25519", ""),
    ],
)
def test_anything_else_is_not_a_host_key(key_type, value):
    assert host_key_line(key_type, value) is None


def test_a_disk_knows_its_name_and_zone():
    disk = DiskInfo("projects/p/zones/us-central2-b/disks/imagenet", "READ_ONLY")

    assert (disk.name, disk.zone) == ("imagenet", "us-central2-b")

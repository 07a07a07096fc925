"""Node metadata through the Cloud TPU door: reading it, and adding or removing one
``ssh-keys`` line with a read-modify-write that keeps everything else byte for byte
and notices a change made elsewhere, against the emulator over real gRPC."""

from __future__ import annotations

import pytest

from tpus.cloud import CloudError, KeyLine
from tpus.cloud.sshkeys import with_line, without_line

PROJECT = "lab-project"
ZONE = "us-central2-b"
PORTAL = KeyLine(
    "tpu-portal", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPortalKeyBlob tpu-portal@vision"
)
# Someone's own keys, with a CRLF line, a blank line and no final newline.
THEIRS = (
    "alice:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAliceBlob alice@laptop\r\n"
    "\n"
    'bob:ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABBobBlob google-ssh {"userName":"bob"}'
)


@pytest.fixture
def node(tpu_emulator):
    tpu_emulator.controls.add_node(
        PROJECT,
        ZONE,
        "tpu1",
        metadata={"ssh-keys": THEIRS, "startup-script": "#!/bin/sh\necho hi  \n"},
    )
    tpu_emulator.operation_delay = 0.02  # the client really polls the operation
    return tpu_emulator


def test_node_metadata_is_read_as_the_api_shows_it(node):
    assert node.client.node_metadata(PROJECT, ZONE, "tpu1") == {
        "ssh-keys": THEIRS,
        "startup-script": "#!/bin/sh\necho hi  \n",
    }


def test_adding_the_portal_line_keeps_every_other_key_and_line_byte_for_byte(node):
    change = node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    metadata = node.controls.metadata("tpu1")
    assert change.changed is True
    assert metadata["startup-script"] == "#!/bin/sh\necho hi  \n"
    assert metadata["ssh-keys"] == THEIRS + "\n" + PORTAL.text
    assert node.client.calls["UpdateNode"] == 1
    assert node.requests["GetOperation"] >= 1


def test_adding_a_line_that_is_there_writes_nothing(node):
    node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)
    node.client.reset_calls()
    renamed = KeyLine(PORTAL.user, PORTAL.public_line.replace("tpu-portal@vision", "old"))

    change = node.client.add_ssh_key(PROJECT, ZONE, "tpu1", renamed)

    assert change.changed is False
    assert node.client.calls["UpdateNode"] == 0


def test_removing_the_portal_line_gives_back_exactly_what_was_there(node):
    node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    change = node.client.remove_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    assert change.changed is True
    assert node.controls.metadata("tpu1") == {
        "ssh-keys": THEIRS,
        "startup-script": "#!/bin/sh\necho hi  \n",
    }


def test_removing_the_only_line_removes_the_key_and_removing_again_is_success(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1", metadata={"other": "x"})
    client = tpu_emulator.client
    client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)
    assert tpu_emulator.controls.metadata("tpu1")["ssh-keys"] == PORTAL.text

    client.remove_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)
    again = client.remove_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    assert tpu_emulator.controls.metadata("tpu1") == {"other": "x"}
    assert again.changed is False


def test_a_change_made_between_the_read_and_the_write_is_not_lost(node):
    carol = "carol:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICarolBlob carol@desk"
    node.controls.change_metadata_after_next_get(
        "tpu1", {"ssh-keys": THEIRS + "\n" + carol, "new-key": "set meanwhile"}
    )

    change = node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    metadata = node.controls.metadata("tpu1")
    assert change.attempts == 2  # it noticed the change and started over
    assert metadata["ssh-keys"] == THEIRS + "\n" + carol + "\n" + PORTAL.text
    assert metadata["new-key"] == "set meanwhile"
    assert metadata["startup-script"] == "#!/bin/sh\necho hi  \n"


def test_a_busy_node_is_tried_again_and_a_permanent_conflict_gives_up_clearly(node):
    node.controls.fail(1, "ABORTED", method="UpdateNode")

    assert node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL).attempts == 2

    client = node.client_with(metadata_attempts=2, metadata_retry_pause=0.01)
    node.controls.fail(5, "ABORTED", method="UpdateNode")
    with pytest.raises(CloudError) as caught:
        client.remove_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)
    assert (caught.value.code, caught.value.retryable) == ("ABORTED", True)
    assert "2 tries" in str(caught.value)
    assert PORTAL.text in node.controls.metadata("tpu1")["ssh-keys"]


def test_a_node_the_portal_may_not_update_answers_permission_denied(node):
    node.controls.deny_update("tpu1")

    with pytest.raises(CloudError) as caught:
        node.client.add_ssh_key(PROJECT, ZONE, "tpu1", PORTAL)

    assert (caught.value.code, caught.value.retryable) == ("PERMISSION_DENIED", False)
    assert "tpu.nodes.update" in str(caught.value)
    assert node.client.calls["UpdateNode"] == 1  # a refused write is not retried
    assert node.controls.metadata("tpu1")["ssh-keys"] == THEIRS


def test_v2_update_node_replaces_the_whole_metadata_map(node):
    """The API's own behaviour, which is why the door edits a copy of the whole map."""
    from google.cloud import tpu_v2

    v2, _ = node.client._tpu()
    name = f"projects/{PROJECT}/locations/{ZONE}/nodes/tpu1"
    operation = v2.update_node(
        request=tpu_v2.UpdateNodeRequest(
            node=tpu_v2.Node(name=name, metadata={"only": "this"}),
            update_mask={"paths": ["metadata"]},
        )
    )
    operation.result(timeout=5)

    assert node.controls.metadata("tpu1") == {"only": "this"}


@pytest.mark.parametrize(
    ("value", "added"),
    [
        ("", PORTAL.text),
        ("a:ssh-ed25519 AAAA x\n", "a:ssh-ed25519 AAAA x\n" + PORTAL.text + "\n"),
        ("a:ssh-ed25519 AAAA x\r\n", "a:ssh-ed25519 AAAA x\r\n" + PORTAL.text + "\r\n"),
        ("a:ssh-ed25519 AAAA x", "a:ssh-ed25519 AAAA x\n" + PORTAL.text),
    ],
)
def test_a_line_is_added_in_the_style_of_the_value_and_removed_without_a_trace(value, added):
    assert with_line(value, PORTAL) == added
    assert without_line(added, PORTAL) == value


def test_a_key_line_refuses_what_would_become_a_second_line():
    with pytest.raises(ValueError):
        KeyLine("tpu-portal", "ssh-ed25519 AAAA x\nroot:ssh-ed25519 BBBB y")
    with pytest.raises(ValueError):
        KeyLine("a:b", "ssh-ed25519 AAAA x")

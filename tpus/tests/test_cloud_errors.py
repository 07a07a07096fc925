"""Failures of the Cloud TPU API become one CloudError that says whether to retry."""

from __future__ import annotations

import pytest
from google.api_core import exceptions as api_exceptions

from tpus.cloud import CloudConfig, CloudError, CloudTPU
from tpus.cloud.errors import to_cloud_error

PROJECT = "lab-project"
ZONE = "us-central2-b"


def test_a_missing_node_is_not_found_and_not_retryable(tpu_emulator):
    with pytest.raises(CloudError) as caught:
        tpu_emulator.client.get_node(PROJECT, ZONE, "ghost")

    assert caught.value.code == "NOT_FOUND"
    assert caught.value.retryable is False
    assert f"projects/{PROJECT}/locations/{ZONE}/nodes/ghost" in str(caught.value)
    assert tpu_emulator.client.calls["GetNode"] == 1


def test_an_unavailable_api_is_retried_until_it_answers(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")
    tpu_emulator.controls.fail(2, "UNAVAILABLE", method="ListNodes")

    nodes = tpu_emulator.client.list_nodes(PROJECT, ZONE)

    assert [n.name for n in nodes] == ["tpu1"]
    assert tpu_emulator.client.calls["ListNodes"] == 3
    assert tpu_emulator.requests["ListNodes"] == 3


def test_retries_give_up_after_a_few_attempts_and_say_retrying_may_help(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")
    tpu_emulator.controls.fail(10, "RESOURCE_EXHAUSTED")

    with pytest.raises(CloudError) as caught:
        tpu_emulator.client.get_node(PROJECT, ZONE, "tpu1")

    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert caught.value.retryable is True
    assert tpu_emulator.client.calls["GetNode"] == 3


def test_permission_denied_is_not_retried_and_explains_itself(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")
    tpu_emulator.controls.fail(1, "PERMISSION_DENIED")

    with pytest.raises(CloudError) as caught:
        tpu_emulator.client.list_nodes(PROJECT, ZONE)

    error = caught.value
    assert (error.code, error.retryable, error.method) == ("PERMISSION_DENIED", False, "ListNodes")
    assert "ListNodes failed: PERMISSION_DENIED" in str(error)
    assert "service account" in str(error)
    assert tpu_emulator.client.calls["ListNodes"] == 1
    # The fault was used up by that one call; the next one succeeds.
    assert [n.name for n in tpu_emulator.client.list_nodes(PROJECT, ZONE)] == ["tpu1"]


def test_a_failed_write_is_not_retried(tpu_emulator):
    tpu_emulator.controls.add_node(PROJECT, ZONE, "tpu1")
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "data")
    tpu_emulator.controls.fail(1, "UNAVAILABLE", method="UpdateNode")

    with pytest.raises(CloudError) as caught:
        tpu_emulator.client.attach_disk(PROJECT, ZONE, "tpu1", "data")

    assert caught.value.retryable is True  # the caller may try again later
    assert tpu_emulator.client.calls["UpdateNode"] == 1


def test_an_unreachable_endpoint_is_a_retryable_error():
    # Port 9 on loopback: nothing listens there, and nothing leaves this machine.
    client = CloudTPU(
        CloudConfig(
            endpoint="127.0.0.1:9", insecure=True, timeout=2.0, retry_attempts=2, retry_initial=0.01
        )
    )

    with pytest.raises(CloudError) as caught:
        client.get_node(PROJECT, ZONE, "tpu1")

    assert caught.value.code in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
    assert caught.value.retryable is True
    assert client.calls["GetNode"] == 2


def test_an_unreadable_credentials_file_is_an_authentication_error(tmp_path):
    client = CloudTPU(CloudConfig(credentials_file=str(tmp_path / "missing.json")))

    with pytest.raises(CloudError) as caught:
        client.get_node(PROJECT, ZONE, "tpu1")

    assert (caught.value.code, caught.value.retryable) == ("UNAUTHENTICATED", False)
    assert "credentials" in str(caught.value)


@pytest.mark.parametrize(
    ("exception", "code", "retryable"),
    [
        (api_exceptions.ServiceUnavailable("x"), "UNAVAILABLE", True),
        (api_exceptions.DeadlineExceeded("x"), "DEADLINE_EXCEEDED", True),
        (api_exceptions.ResourceExhausted("x"), "RESOURCE_EXHAUSTED", True),
        (api_exceptions.InternalServerError("x"), "INTERNAL", True),
        (api_exceptions.Aborted("x"), "ABORTED", True),
        (api_exceptions.NotFound("x"), "NOT_FOUND", False),
        (api_exceptions.PermissionDenied("x"), "PERMISSION_DENIED", False),
        (api_exceptions.InvalidArgument("x"), "INVALID_ARGUMENT", False),
        (api_exceptions.FailedPrecondition("x"), "FAILED_PRECONDITION", False),
        (api_exceptions.Unauthenticated("x"), "UNAUTHENTICATED", False),
    ],
)
def test_each_status_code_says_whether_retrying_helps(exception, code, retryable):
    error = to_cloud_error("GetNode", exception)

    assert (error.code, error.retryable) == (code, retryable)


def test_a_bug_of_ours_is_not_disguised_as_a_cloud_error():
    assert to_cloud_error("GetNode", KeyError("oops")) is None

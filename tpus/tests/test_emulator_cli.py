"""``python -m tpus.emulator``: one command serves it, and control commands run in other
processes change what the running server answers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tpus.cloud import CloudError, CloudTPU, KeyLine
from tpus.emulator.controls import new_host_key
from tpus.emulator.testing import fast_config, start_emulator

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "lab-project"
ZONE = "us-central2-b"


def _env() -> dict[str, str]:
    env = dict(os.environ, NO_GCE_CHECK="true")
    env["no_proxy"] = "127.0.0.1,localhost," + env.get("no_proxy", "")
    env.pop("TPU_EMULATOR_STATE", None)
    return env


def emulator(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpus.emulator", *args, "--state", str(state)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def control(state: Path, *args: str) -> str:
    result = emulator(state, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def served(tmp_path):
    """``python -m tpus.emulator serve --port 0`` in a child process, and a client."""
    state = tmp_path / "lab.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "tpus.emulator", "serve", "--port", "0", "--state", str(state)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        assert match, line + process.stderr.read()
        client = CloudTPU(fast_config(match.group(1)))
        yield state, client, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()


def test_controls_from_another_process_change_the_running_server(served):
    state, client, _ = served
    key = new_host_key()
    control(
        state,
        "add-node",
        PROJECT,
        ZONE,
        "tpu5",
        "--type",
        "v4-32",
        "--workers",
        "4",
        *[arg for i in range(4) for arg in ("--internal-ip", f"10.0.0.{10 + i}")],
        *[arg for i in range(4) for arg in ("--external-ip", f"203.0.113.{10 + i}")],
        "--host-key",
        "0",
        "ssh-ed25519",
        key,
    )
    node = client.get_node(PROJECT, ZONE, "tpu5")
    assert [w.external_ip for w in node.workers] == [f"203.0.113.{10 + i}" for i in range(4)]
    assert client.guest_host_keys(PROJECT, ZONE, "tpu5").for_worker(0) == {
        "ssh-ed25519": f"ssh-ed25519 {key}"
    }

    control(state, "set-ip", "tpu5", "2", "198.51.100.7")
    assert client.get_node(PROJECT, ZONE, "tpu5").workers[2].external_ip == "198.51.100.7"

    control(state, "maintenance", "tpu5")
    during = client.get_node(PROJECT, ZONE, "tpu5")
    assert during.health == "UNHEALTHY_MAINTENANCE"
    assert {w.external_ip for w in during.workers} == {None}

    ips = [f"198.51.100.{20 + i}" for i in range(4)]
    control(state, "maintenance-end", "tpu5", *[a for ip in ips for a in ("--external-ip", ip)])
    after = client.get_node(PROJECT, ZONE, "tpu5")
    assert (after.state, after.health) == ("READY", "HEALTHY")
    assert [w.external_ip for w in after.workers] == ips

    control(state, "fail", "1", "UNAVAILABLE", "--method", "GetNode")
    client.reset_calls()
    assert client.get_node(PROJECT, ZONE, "tpu5").name == "tpu5"
    assert client.calls["GetNode"] == 2  # retried once

    control(state, "preempt", "tpu5")
    assert client.get_node(PROJECT, ZONE, "tpu5").state == "PREEMPTED"

    control(state, "delete", "tpu5")
    with pytest.raises(CloudError) as caught:
        client.get_node(PROJECT, ZONE, "tpu5")
    assert caught.value.code == "NOT_FOUND"


def test_disks_added_on_the_command_line_can_be_attached(served):
    state, client, _ = served
    control(state, "add-node", PROJECT, ZONE, "tpu1")
    assert control(state, "add-disk", PROJECT, ZONE, "data").strip() == (
        f"projects/{PROJECT}/zones/{ZONE}/disks/data"
    )

    node = client.attach_disk(PROJECT, ZONE, "tpu1", "data", "READ_ONLY")

    assert [d.name for d in node.data_disks] == ["data"]
    shown = json.loads(control(state, "show"))
    assert shown["nodes"][f"projects/{PROJECT}/locations/{ZONE}/nodes/tpu1"]["data_disks"]


def test_the_state_survives_a_restart_of_the_server(served):
    state, client, process = served
    control(state, "add-node", PROJECT, ZONE, "keeper")

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    restarted = start_emulator(state)
    try:
        assert [n.name for n in restarted.client.list_nodes(PROJECT, ZONE)] == ["keeper"]
    finally:
        restarted.stop()


def test_concurrent_control_commands_lose_no_change(tmp_path):
    state = tmp_path / "lab.json"

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(
            pool.map(lambda i: emulator(state, "add-node", PROJECT, ZONE, f"n{i}"), range(4))
        )

    assert [r.returncode for r in results] == [0] * 4
    assert len(json.loads(control(state, "show"))["nodes"]) == 4


def test_a_bad_control_says_what_is_wrong(tmp_path):
    state = tmp_path / "lab.json"
    control(state, "add-node", PROJECT, ZONE, "tpu1", "--workers", "1")

    result = emulator(state, "set-ip", "tpu1", "3", "203.0.113.1")
    unknown = emulator(state, "fail", "1", "NOT_A_CODE")

    assert result.returncode == 2
    assert "no worker 3" in result.stderr
    assert unknown.returncode == 2
    assert "UNAVAILABLE" in unknown.stderr  # lists the codes it knows


def test_serving_on_a_taken_port_fails_loudly(tpu_emulator, tmp_path):
    result = emulator(tmp_path / "other.json", "serve", "--port", str(tpu_emulator.port))

    assert result.returncode == 2
    assert f"127.0.0.1:{tpu_emulator.port}" in result.stderr


def test_metadata_controls_on_the_command_line_change_what_the_server_answers(served, tmp_path):
    state, client, _ = served
    keys = tmp_path / "keys"
    keys.write_text("alice:ssh-ed25519 AAAA alice\nbob:ssh-ed25519 BBBB bob\n")
    control(state, "add-node", PROJECT, ZONE, "tpu1", "--metadata", "team=vision")
    control(state, "set-metadata", "tpu1", "--metadata-from-file", f"ssh-keys={keys}")
    control(state, "deny-update", "tpu1")
    control(state, "oslogin", PROJECT, "on")

    assert client.node_metadata(PROJECT, ZONE, "tpu1") == {
        "team": "vision",
        "ssh-keys": keys.read_text(),
    }
    assert json.loads(control(state, "metadata", "tpu1"))["team"] == "vision"
    with pytest.raises(CloudError) as caught:
        client.remove_ssh_key(PROJECT, ZONE, "tpu1", KeyLine("bob", "ssh-ed25519 BBBB bob"))
    assert caught.value.code == "PERMISSION_DENIED"
    assert json.loads(control(state, "show"))["projects"][PROJECT] == {"enable_oslogin": True}

    control(state, "deny-update", "tpu1", "--allow")
    control(state, "set-metadata", "tpu1", "--remove", "team", "--after-next-get")
    assert client.node_metadata(PROJECT, ZONE, "tpu1")["team"] == "vision"  # read, then changed
    assert "team" not in client.node_metadata(PROJECT, ZONE, "tpu1")

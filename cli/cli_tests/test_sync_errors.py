"""A worker that ``tpu run`` cannot sync to is named with what ssh said about it (the
real cause), not only rsync's last line, which says only that the connection closed."""

from __future__ import annotations

import shutil
import socket

import pytest

from tests.requirements import need
from tpu_cli import remote, work
from tpu_cli.errors import CliError


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_worker_that_refuses_the_connection_is_named_with_ssh_s_reason(tmp_path):
    need(bool(shutil.which("rsync") and shutil.which("ssh")), "needs rsync and ssh")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "train.py").write_text("print(1)\n")
    ssh = ["ssh", "-F", "/dev/null", "-p", str(_closed_port()), "-o", "BatchMode=yes"]
    argv = remote.rsync_argv(ssh, tmp_path / "work", "127.0.0.1", "work")
    results = remote.sync_parallel({0: argv}, lambda i, pct: None)
    assert results[0].status != 0  # 255 or 12, as rsync saw the connection close
    with pytest.raises(CliError) as refused:
        work._report_sync(results, {0: "tpu5"}, tmp_path / "work", "work", 0.1)
    message = str(refused.value)
    assert message.startswith("Could not sync the workdir to every worker; nothing was run.")
    assert "w0 (tpu5): ssh: connect to host 127.0.0.1 port" in message
    assert "Connection refused" in message and "rsync error" in message

"""The Celery workers the tests start share nothing with an earlier test or run: they
start on an empty queue, and they end with the test process that started them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e import ROOT, purge_queue


def _held(client, tag: str, queue: str) -> None:
    """An entry as Redis's transport keeps a message a worker took and never acked."""
    client.hset("unacked", tag, json.dumps([{"body": ""}, "", queue]))
    client.zadd("unacked_index", {tag: time.time() - 7200})


@pytest.mark.filterwarnings("ignore::celery.exceptions.AlwaysEagerIgnored")  # sent on purpose
def test_a_queue_is_emptied_of_what_an_earlier_test_left_and_only_that_queue(db, settings):
    from portal.celery import app

    mine = f"{settings.CELERY_TASK_DEFAULT_QUEUE}-left-over"
    other = f"{mine}-not-mine"
    for _ in range(2):
        app.send_task("tpus.tasks.reconcile_vm", args=(0,), queue=mine)
    app.send_task("tpus.tasks.reconcile_vm", args=(0,), queue=other)
    with app.connection_for_write() as conn:
        redis = conn.transport_cls.startswith("redis")
        client = conn.default_channel.client if redis else None
    if redis:
        _held(client, f"{mine}-tag", mine)
        _held(client, f"{other}-tag", other)
    try:
        assert purge_queue(mine) == (3 if redis else 2)
        assert purge_queue(mine) == 0
        if redis:
            assert client.hexists("unacked", f"{other}-tag")
            assert client.zscore("unacked_index", f"{other}-tag") is not None
            assert not client.hexists("unacked", f"{mine}-tag")
    finally:
        assert purge_queue(other) == (2 if redis else 1)


def test_a_worker_started_in_a_session_of_its_own_ends_when_its_test_process_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", (
            "import subprocess, time\n"
            "from tests.e2e import ends_with_this_process\n"
            "child = subprocess.Popen(['sleep', '60'], start_new_session=True,\n"
            "                         preexec_fn=ends_with_this_process)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n"
        )],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(parent.stdout.readline())
    try:
        assert os.getsid(child) == child  # not in the parent's group: killpg misses it
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(child):
            if time.monotonic() > deadline:
                pytest.fail("the child outlived the process that started it")
            time.sleep(0.02)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

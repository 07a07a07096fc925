"""bin/demo prints where to go only once the portal answers: ``portal.wait_for_web``
waits for any HTTP answer, and gives up, saying why, when the server's process ended
or the time is up."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time

from portal import wait_for_web


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)  # /healthz before beat's first heartbeat
        self.end_headers()

    def log_message(self, *args):
        pass


def test_it_returns_only_once_the_server_answers_whatever_the_status():
    port = _free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), _Unavailable)
    threading.Timer(1.5, lambda: threading.Thread(target=server.serve_forever).start()).start()
    try:
        began = time.monotonic()
        assert wait_for_web.wait(f"http://127.0.0.1:{port}/healthz", pid=None, timeout=30) is None
        assert time.monotonic() - began >= 1.4
    finally:
        time.sleep(0.1)
        server.shutdown()
        server.server_close()


def test_it_gives_up_when_the_process_ended_or_the_time_is_up():
    port = _free_port()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    url = f"http://127.0.0.1:{port}/healthz"

    assert wait_for_web.wait(url, pid=ended.pid, timeout=30) == (
        f"the process {ended.pid} ended before {url} answered"
    )
    assert wait_for_web.wait(url, pid=None, timeout=0.5) == f"{url} did not answer within 0 s"
    done = subprocess.run(
        [sys.executable, "-m", "portal.wait_for_web", url, "--timeout", "0.3"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == f"wait_for_web: {url} did not answer within 0 s"

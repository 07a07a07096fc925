"""A portal that answers what a test tells it to, on loopback: for what the client must
do when a portal (or whoever answers at its address) sends something it should not
trust, redirects, or refuses."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tpu_cli import credentials


class FakePortal:
    """``routes``: (method, path) -> (status, body, headers); a dict or list body is sent
    as JSON. Every request is kept in ``asked`` as (method, path, JSON body or None)."""

    def __init__(self):
        self.routes: dict[tuple[str, str], tuple[int, Any, dict]] = {}
        self.asked: list[tuple[str, str, Any]] = []
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                portal.asked.append((self.command, self.path, body))
                status, answer, headers = portal.routes.get(
                    (self.command, self.path.split("?")[0]), (404, {"detail": "Not Found"}, {})
                )
                data = answer if isinstance(answer, bytes) else (
                    json.dumps(answer).encode() if isinstance(answer, (dict, list))
                    else str(answer).encode()
                )  # fmt: skip
                self.send_response(status)
                kind = "application/json" if isinstance(answer, (dict, list)) else "text/plain"
                self.send_header("Content-Type", kind)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def on(self, method: str, path: str, body: Any, status: int = 200, **headers) -> None:
        self.routes[(method, "/api/v1" + path)] = (status, body, headers)

    def paths_asked(self) -> list[str]:
        return [f"{method} {path.split('?')[0]}" for method, path, _ in self.asked]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def portal(tmp_path, monkeypatch):
    """A fake portal, and the person signed in to it in a home of the test's own."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("TPU_PORTAL_CONFIG_DIR", raising=False)
    fake = FakePortal()
    credentials.save(credentials.SignIn(url=fake.url, token="tpp_test", email="milo@uni.example"))
    fake.on("GET", "/me", {"id": 1, "email": "milo@uni.example", "full_name": "Milo",
                           "is_site_admin": False})  # fmt: skip
    yield fake
    fake.close()

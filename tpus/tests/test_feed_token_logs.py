"""The ssh-config refresh URL works like a password: request logs show its path with
the token replaced."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from django.core.servers.basehttp import WSGIRequestHandler

from portal.logs import redact
from tpus.services import sshconfig


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def feed_path(make_user):
    user = make_user("milo@uni.example")
    sshconfig.rotate_feed(user)
    url = sshconfig.feed_urls(user)["config"]
    path = url.removeprefix("http://127.0.0.1:8000")
    return path, path.split("/")[3]


def test_a_refused_feed_request_is_logged_without_its_token(client, feed_path, caplog):
    path, token = feed_path
    with caplog.at_level(logging.WARNING, logger="django.request"):
        assert client.post(path).status_code == 405
    [record] = [r for r in caplog.records if r.name == "django.request"]
    assert token not in record.getMessage()
    assert "/ssh/feed/[redacted]/config" in record.getMessage()
    assert token not in caplog.text


def test_the_development_servers_access_log_hides_the_token(feed_path):
    path, token = feed_path
    logger = logging.getLogger("django.server")
    collect = Collect()
    logger.addHandler(collect)
    try:
        handler = SimpleNamespace(request=None, log_date_time_string=lambda: "now")
        WSGIRequestHandler.log_message(handler, '"%s" %s %s', f"GET {path} HTTP/1.1", "200", "9")
    finally:
        logger.removeHandler(collect)
    assert collect.lines == ['"GET /ssh/feed/[redacted]/config HTTP/1.1" 200 9']


def test_the_known_hosts_path_is_redacted_and_other_paths_are_left_alone():
    assert redact("GET /ssh/feed/12-abcdef/known_hosts") == "GET /ssh/feed/[redacted]/known_hosts"
    assert redact("POST /ssh/feed/rotate/ 302") == "POST /ssh/feed/rotate/ 302"
    assert redact("GET /ssh/ 200") == "GET /ssh/ 200"

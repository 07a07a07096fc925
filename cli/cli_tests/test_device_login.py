"""`tpu login` through the browser, as `gh auth login` does: the client shows a code and
a link, milo approves it on the portal's page with his password, and the client ends
up holding a token of his; a denied code leaves it with none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from playwright.sync_api import expect

from accounts.models import ApiToken

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TPU = str(Path(sys.executable).parent / "tpu")
PASSWORD = "a long passphrase 42"


def _login(url: str, home: Path) -> tuple[subprocess.Popen, str, str]:
    """`tpu login` started on a laptop whose home is ``home``; returns it, the link it
    printed and the code to type there."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    client = subprocess.Popen(
        [TPU, "login", url, "--no-browser", "--device-name", "milo-laptop"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    shown = []
    for line in client.stderr:
        shown.append(line)
        found = re.search(r"Type it to approve this device \(milo-laptop\) at: (\S+)", line)
        if found:
            code = re.search(r"Your one-time code: ([A-Z0-9]{4}-[A-Z0-9]{4})", "".join(shown))
            assert code, shown
            return client, found.group(1), code.group(1)
    raise AssertionError(f"no link in {shown}")


def _type_code(page, link: str, code: str) -> None:
    page.goto(link)
    page.fill("input[name=code]", code)
    page.get_by_role("button", name="Continue").click()


def test_milo_signs_the_client_in_from_his_browser(page, live_server, make_user, tmp_path):
    milo = make_user("milo@uni.example", password=PASSWORD)
    page.goto("/accounts/login/")
    page.fill("input[name=login]", "milo@uni.example")
    page.fill("input[name=password]", PASSWORD)
    page.click("form button[type=submit]")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)

    # A code he did not mean to give: denied, and the client says so.
    client, link, code = _login(live_server.url, tmp_path)
    assert "code=" not in link  # the plain page: he types the code, as a person would
    _type_code(page, link, code)
    expect(page.locator("body")).to_contain_text("milo-laptop")
    expect(page.locator("#link-warning")).to_have_count(0)
    page.get_by_role("button", name="Deny").click()
    expect(page.locator("body")).to_contain_text("gets no token")
    assert client.wait(timeout=60) == 3
    assert "The sign-in was refused on the portal." in client.stderr.read()
    assert not (tmp_path / ".config" / "tpu-portal" / "credentials.json").exists()

    # His own: approved with his password; the client holds a token of his.
    client, link, code = _login(live_server.url, tmp_path)
    _type_code(page, link, code)
    page.get_by_label("Your password").fill(PASSWORD)
    page.get_by_role("button", name="Approve").click()
    expect(page.locator("body")).to_contain_text("is signed in as milo@uni.example")
    assert client.wait(timeout=60) == 0, client.stderr.read()
    assert f"Signed in to {live_server.url} as milo@uni.example" in client.stderr.read()
    saved = json.loads((tmp_path / ".config" / "tpu-portal" / "credentials.json").read_text())
    assert saved["email"] == "milo@uni.example" and saved["token"].startswith("tpp_")
    [token] = ApiToken.objects.filter(user=milo, revoked_at=None)
    assert saved["token"].startswith(token.hint)

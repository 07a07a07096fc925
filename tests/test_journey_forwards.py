"""The port-forward helper of the ssh page in a real browser: htmx swaps just the VM's
box, a bad port says why and keeps nothing, a good one gives the exact ssh line, and an
added forward is in the config the page's link downloads."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from accounts.unix import choose_username
from tpus.models import Grant, PortForward, TpuVm, Worker

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)


def test_milo_gets_the_ssh_line_and_keeps_a_forward_in_his_config(
    page, live_server, make_lab, make_user, add_member, tmp_path
):
    lab = make_lab("Vision Lab", slug="vision")
    milo = make_user("milo@uni.example", password=PASSWORD)
    add_member(lab, milo)
    choose_username(milo, "milo")
    vm = TpuVm.objects.create(lab=lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10", host_keys=[])
    Grant.objects.create(user=milo, vm=vm, state="active")

    page.goto("/accounts/login/")
    page.fill("input[name=login]", "milo@uni.example")
    page.fill("input[name=password]", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto("/ssh/")
    page.wait_for_load_state("load")
    expect(page.locator("#editors")).to_contain_text("Remote-SSH: Connect to Host…")
    page.evaluate("window.notReloaded = true")
    box = page.locator(f"#forwards-{vm.pk}")
    local, remote = box.get_by_label("Local port"), box.get_by_label("Port on tpu5")

    local.fill("80")
    box.get_by_role("button", name="Show the ssh line").click()
    expect(box.get_by_role("alert")).to_have_text(
        "The local port must be from 1024 to 65535, not 80: lower ports are reserved for"
        " the system."
    )
    expect(box.locator(".forward-line")).to_have_count(0)
    local.fill("16006")
    remote.fill("6006")
    box.get_by_role("button", name="Show the ssh line").click()
    expect(box.locator(".forward-line")).to_have_text("ssh -N -L 16006:localhost:6006 tpu5")
    assert not PortForward.objects.exists()

    box.get_by_role("button", name="Add to my config").click()
    expect(box.locator("li")).to_contain_text("LocalForward 16006 localhost:6006")
    remote.fill("8888")
    box.get_by_role("button", name="Add to my config").click()
    expect(box.get_by_role("alert")).to_contain_text(
        "Local port 16006 is already forwarded to port 6006 on tpu5"
    )
    assert list(PortForward.objects.values_list("local_port", "remote_port")) == [(16006, 6006)]
    assert page.evaluate("window.notReloaded === true"), "the page was reloaded"

    with page.expect_download() as download:
        page.click("text=Download config")
    config = tmp_path / "tpu-portal"
    download.value.save_as(config)
    assert "    LocalForward 16006 localhost:6006\n" in config.read_text()

    page.reload()
    box.get_by_role("button", name="Remove").click()
    expect(box.locator("li")).to_have_count(0)
    assert not PortForward.objects.exists()

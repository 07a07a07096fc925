"""Journeys 2, 3, 4 and 6 in a real browser, on the sshd fleet: a lab admin approves
milo and adds him to tpu5 (a 4-worker pod) while the page follows each worker; milo
downloads his ssh config and logs in with plain ssh; Google moves a worker and milo's
refresh URL puts him back in; the admin revokes him and he is locked out.

Everything goes the production way: the browser talks to the live server, grants and
the inventory sync are tasks a real Celery worker takes from the broker, the worker
reaches the fleet over SSH, and mail goes through a real SMTP server."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import expect

from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.e2e import expect_every_worker_up_to_date
from tpus.models import Grant, Lab, Membership, TpuVm
from tpus.services import inventory

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.fleet]

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)


@pytest.fixture
def worker_env(monkeypatch, settings, live_server, tpu_emulator, fleet_settings, fleet_uids):
    """The scene as the Celery worker process must see it: the same emulator, the
    fleet's admin key, this run's UIDs, and links that point at the live server."""
    monkeypatch.setenv("PORTAL_UID_MIN", str(settings.PORTAL_UID_MIN))
    monkeypatch.setenv("PORTAL_UID_MAX", str(settings.PORTAL_UID_MAX))
    settings.SITE_URL = live_server.url
    monkeypatch.setenv("SITE_URL", live_server.url)
    monkeypatch.setenv("PORTAL_TEST_TPU_API_ENDPOINT", settings.TPU_API_ENDPOINT)
    monkeypatch.setenv("PORTAL_ADMIN_SSH_KEY_FILE", settings.PORTAL_ADMIN_SSH_KEY_FILE)
    monkeypatch.setenv("PORTAL_ADMIN_SSH_USER", settings.PORTAL_ADMIN_SSH_USER)
    monkeypatch.setenv("PORTAL_REMOTE_CONNECT_TIMEOUT", "5")
    monkeypatch.setenv("PORTAL_REMOTE_AUTH_TIMEOUT", "10")
    monkeypatch.setenv("PORTAL_REMOTE_SCRIPT_TIMEOUT", "60")


@pytest.fixture
def worker(worker_env, celery_worker_process):
    return celery_worker_process


@dataclass
class Scene:
    lab: Lab
    vm: TpuVm
    hosts: list  # tpu5's workers, in order
    spare: object  # a fleet host that is not part of tpu5
    request: Membership
    username: str
    key: Path
    public_key: str


@pytest.fixture
def scene(
    worker, tpu_emulator, fleet, fleet_hosts, fleet_username, tmp_path,
    make_lab, make_user, add_member,
) -> Scene:  # fmt: skip
    *hosts, spare = fleet_hosts(5)
    lab = make_lab("Vision Lab", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example", password=PASSWORD)
    request = add_member(lab, milo, state="requested")
    Membership.objects.filter(pk=request.pk).update(purpose="Training ViTs on ImageNet.")
    key = tmp_path / "id_milo"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "milo@laptop", "-f", str(key)],
        check=True,
    )
    public = key.with_suffix(".pub").read_text().strip()
    return Scene(lab, vm, hosts, spare, request, fleet_username, key, public)


@pytest.fixture
def sign_in(browser, live_server):
    """``sign_in(email)``: a page in a browser context of its own, signed in through
    the login form."""
    contexts = []

    def open_as(email: str):
        context = browser.new_context(base_url=live_server.url)
        context.set_default_timeout(15_000)
        contexts.append(context)
        page = context.new_page()
        page.goto("/accounts/login/")
        page.fill("input[name=login]", email)
        page.fill("input[name=password]", PASSWORD)
        page.click("form button[type=submit]")
        page.wait_for_url(lambda url: "/accounts/login/" not in url)
        return page

    yield open_as
    for context in contexts:
        context.close()


def _ssh(config: Path, known: Path, key: Path, host: str, command: str = "true"):
    """Plain ssh with the downloaded files: strict host key checking, no prompt."""
    return subprocess.run(
        ["ssh", "-F", str(config), "-o", f"UserKnownHostsFile={known}", "-i", str(key),
         "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=5", host, command],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _download(page, link_text: str, to: Path) -> Path:
    with page.expect_download() as download:
        page.click(f"text={link_text}")
    download.value.save_as(to)
    return to


def _processes_of(fleet, host, uid: int) -> list[str]:
    out = fleet.exec(
        host.name, ["sh", "-c", f"ps -e -o pid=,ruid=,stat= | awk '$2 == {uid} && $3 !~ /^Z/'"]
    ).stdout.decode()
    return [line for line in out.splitlines() if line.strip()]


def test_milo_is_added_to_a_pod_follows_an_ip_change_and_is_revoked(
    scene, sign_in, smtp_sink, fleet, tpu_emulator, tmp_path
):
    from tpus import tasks
    from tpus.services.sync import sync_inventory

    lab, vm, hosts = scene.lab, scene.vm, scene.hosts

    # Milo, signed in, adds his key and chooses his unix username.
    milo = sign_in("milo@uni.example")
    milo.goto("/account/keys/")
    milo.fill("textarea[name=key_text]", scene.public_key)
    milo.click("text=Add key")
    expect(milo.locator("body")).to_contain_text("Key added")
    milo.fill("input[name=username]", scene.username)
    milo.click("form[action='/account/keys/username/'] button")
    expect(milo.locator("body")).to_contain_text(f"Your unix username is {scene.username}")

    # Journey 2: the admin approves milo's request on the lab's admin page (htmx).
    admin = sign_in("boss@vision.example")
    admin.goto(f"/labs/{lab.slug}/admin/")
    row = admin.locator(f"#membership-{scene.request.pk}")
    expect(row).to_contain_text("milo@uni.example")
    expect(row).to_contain_text("Training ViTs on ImageNet.")
    row.get_by_role("button", name="Approve").click()
    expect(row.locator(".badge")).to_have_text("Approved")

    # … then opens tpu5 and adds milo; the page follows every worker by itself.
    admin.click("text=TPU VMs")
    admin.click(f"a:text-is('{vm.name}')")
    admin.get_by_role("navigation", name=vm.name).get_by_role("link", name="Access").click()
    admin.wait_for_url(f"**/labs/{lab.slug}/vms/{vm.pk}/access/")
    admin.wait_for_load_state("load")  # htmx has wired the page up
    picker = admin.get_by_role("combobox", name="Member")
    picker.fill("milo@")
    expect(admin.locator("#grant-user-options [role=option]")).to_have_count(1, timeout=15_000)
    picker.press("ArrowDown")
    picker.press("Enter")
    expect(picker).to_have_value(scene.username)
    polls = []
    admin.on("request", lambda r: polls.append(r.url) if "/progress/" in r.url else None)
    admin.click(f"text=Add to {vm.name}")
    admin.wait_for_url(f"**/labs/{lab.slug}/vms/{vm.pk}/access/")
    admin.evaluate("window.notReloaded = true")
    progress = admin.locator("#vm-progress")
    expect_every_worker_up_to_date(progress, 4)
    grant = Grant.objects.get(user__email="milo@uni.example", vm=vm)
    expect(progress.locator(f"#grant-{grant.pk} .badge")).to_have_text("Active")
    # The "Adding milo…" notice says it is done, without a reload.
    expect(admin.locator(f"#notice-grant-{grant.pk}")).to_have_text(
        f"{scene.username} can now use {vm.name}."
    )
    assert admin.evaluate("window.notReloaded === true"), "the page was reloaded"
    assert polls, "the progress never refreshed itself"
    admin.screenshot(path=tmp_path / "vm-page-after-grant.png", full_page=True)

    welcome = smtp_sink.wait_for("milo@uni.example", f"You can now use {vm.name}", timeout=30)
    body = smtp_sink.body(welcome)
    assert vm.name in body and f"Host {vm.name}" in body
    for host in hosts:
        assert host.ip in body
    assert f"HostName {hosts[0].ip}" in body and f"User {scene.username}" in body
    # The email's lines work as they are, for someone who keeps nothing else: its Host
    # blocks in an ssh config, and its host keys where the blocks say (pinned, no prompt).
    text = body.replace("\r\n", "\n")
    blocks = text.split("add these lines to your ~/.ssh/config:\n\n", 1)[-1]
    blocks = blocks.split("\n\nand these host keys", 1)[0]
    keys = text.split('"Host key verification failed"):\n\n', 1)[-1].split("\nThen log in", 1)[0]
    assert f"Host {vm.name}\n" in blocks, text
    (tmp_path / "emailed").write_text(blocks + "\n")
    (tmp_path / "emailed_known_hosts").write_text(keys)
    first = subprocess.run(
        ["ssh", "-F", str(tmp_path / "emailed"), "-i", str(scene.key), "-o", "IdentitiesOnly=yes",
         "-o", f"UserKnownHostsFile={tmp_path / 'emailed_known_hosts'}", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=5", vm.name, "id -un"],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert first.returncode == 0, (blocks, first.stderr)
    assert first.stdout.strip() == scene.username

    # Journey 3: milo downloads his ssh config and known_hosts and logs in with ssh,
    # on every worker of the pod.
    milo.goto("/ssh/")
    config = _download(milo, "Download config", tmp_path / "config")
    known = _download(milo, "Download known_hosts", tmp_path / "known_hosts")
    for host in (vm.name, *(f"{vm.name}-w{i}" for i in range(len(hosts)))):
        result = _ssh(config, known, scene.key, host, "id -un")
        assert result.returncode == 0, (host, result.stderr)
        assert result.stdout.strip() == scene.username
    milo.click("text=Make a refresh URL")
    refresh_command = milo.locator("#refresh-command").inner_text()
    config_url, known_url = re.findall(r"curl -fsS (\S+) -o", refresh_command)
    milo.screenshot(path=tmp_path / "ssh-page.png", full_page=True)

    # Journey 4: Google gives worker 0 another address; the beat's sync notices.
    old_ip = hosts[0].ip
    new_ip = fleet.move(hosts[0].name, fleet.free_ip())
    tpu_emulator.controls.set_ip(vm.name, 0, new_ip)
    tasks.sync_inventory.delay()
    notice = smtp_sink.wait_for("milo@uni.example", new_ip, timeout=30)
    # The email points to the page with the refresh command; the private URL itself
    # never travels by mail.
    body = smtp_sink.body(notice)
    assert "/ssh/" in body and "refresh command" in body
    assert config_url not in body and "/ssh/feed/" not in body
    sync_inventory()  # a second scheduler's beat sees the same change
    time.sleep(2)
    about_it = [m for m in smtp_sink.messages if new_ip in m["Subject"]]
    assert [m["To"] for m in about_it] == ["milo@uni.example"]

    # Another machine now answers at the old address: the old config cannot reach it.
    fleet.move(scene.spare.name, old_ip)
    stale = _ssh(config, known, scene.key, vm.name, "hostname")
    assert stale.returncode != 0
    assert stale.stdout == ""
    clear_failures = ("IDENTIFICATION HAS CHANGED", "verification failed", "timed out", "No route")
    assert any(reason in stale.stderr for reason in clear_failures), stale.stderr

    # The refresh URL, fetched as cron would, gives a config that works again.
    for url, path in ((config_url, config), (known_url, known)):
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (live server)
            path.write_bytes(response.read())
    assert f"HostName {new_ip}" in config.read_text()
    result = _ssh(config, known, scene.key, vm.name, "id -un")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == scene.username

    # Journey 6: milo has work running; the admin revokes him in the browser.
    uid = Grant.objects.get(pk=grant.pk).user.unix_account.uid
    for host in hosts:
        fleet.exec(
            host.name,
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             "sh", "-c", "nohup sleep 1000 >/dev/null 2>&1 &"],
        )  # fmt: skip
        assert _processes_of(fleet, host, uid)
    admin.goto(f"/labs/{lab.slug}/vms/{vm.pk}/")
    expect(admin.locator("body")).to_contain_text(new_ip)  # the address history
    expect(admin.locator("#vm-access-summary")).to_contain_text("1 person has access")
    admin.locator("#vm-access-summary").get_by_role("link").click()
    admin.once("dialog", lambda dialog: dialog.accept())
    admin.locator(f"#access-{grant.pk}").get_by_role("button", name="Revoke").click()
    expect(admin.locator(f"#grant-{grant.pk} .badge")).to_have_text("Revoked", timeout=30_000)

    smtp_sink.wait_for("milo@uni.example", "has ended", timeout=30)
    for host in (f"{vm.name}-w{i}" for i in range(len(hosts))):
        assert _ssh(config, known, scene.key, host).returncode != 0
    for host in hosts:
        assert _processes_of(fleet, host, uid) == []

"""The ssh config works however it is used: the download, the page's preview and the
grant email give the same lines; the files go where the page says, and then plain
``ssh tpu5`` and ``ssh -F <the config> tpu5`` work from any directory; without the
host keys, what the person sees names the file they lack. All with the real ssh
client, in a home of its own, against the sshd fleet."""

from __future__ import annotations

import html
import re
import shutil
from dataclasses import dataclass

import pytest
from django.core import mail

from accounts.keys import add_key
from accounts.models import User
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.laptop import Laptop, new_key
from tpus.models import TpuVm
from tpus.services import inventory, sshconfig
from tpus.services.grants import grant_access

pytestmark = pytest.mark.fleet

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
CONFIG, KNOWN = sshconfig.CONFIG_PATH, sshconfig.KNOWN_HOSTS_PATH


@dataclass
class Scene:
    milo: User
    vm: TpuVm
    hosts: list
    laptop: Laptop


@pytest.fixture
def scene(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
) -> Scene:  # fmt: skip
    """Milo has access to tpu5, a pod of two workers; his laptop has his key and
    nothing else yet."""
    hosts = fleet_hosts(2)
    lab = make_lab("Vision", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    laptop = Laptop(tmp_path / "home")
    add_key(milo, new_key(laptop))
    milo = User.objects.select_related("unix_account").get(pk=milo.pk)
    mail.outbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    return Scene(milo, vm, hosts, laptop)


def _download(client, laptop: Laptop) -> tuple[str, str]:
    """Both downloads, saved in ~/Downloads under the names the browser is given."""
    saved = []
    for url in ("/ssh/config", "/ssh/known_hosts"):
        response = client.get(url)
        assert response.status_code == 200
        name = re.search(r'filename="([^"]+)"', response["Content-Disposition"]).group(1)
        laptop.path(f"~/Downloads/{name}").write_bytes(response.content)
        saved.append(response.content.decode())
    return saved[0], saved[1]


def _page_pre(page: str, element_id: str) -> str:
    found = re.search(rf'<pre id="{element_id}">(.*?)</pre>', page, re.S)
    assert found, f"no #{element_id} on the page"
    return html.unescape(found.group(1))


def _email_parts(body: str) -> tuple[str, str]:
    body = body.replace("\r\n", "\n")
    blocks = body.split("add these lines to your ~/.ssh/config:\n\n", 1)[1]
    blocks, rest = blocks.split("\n\nand these host keys to", 1)
    known = rest.split(":\n\n", 1)[1].split("\nThen log in with:", 1)[0]
    return blocks, known


def _resolved(laptop: Laptop, config: str, host: str) -> dict[str, str]:
    laptop.path("~/resolve.conf").write_text(config + "\n")
    out = laptop.ssh("-G", "-F", "~/resolve.conf".replace("~", laptop.real_home), host)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def test_the_download_the_page_and_the_grant_email_give_the_same_lines(scene, client):
    client.force_login(scene.milo)
    config, known = _download(client, scene.laptop)
    page = client.get("/ssh/").content.decode()
    preview = _page_pre(page, "ssh-snippet")
    [email] = [m for m in mail.outbox if m.to == ["milo@uni.example"]]
    emailed, emailed_known = _email_parts(email.body)

    # The config is a header and then exactly the blocks the page shows; the email's
    # blocks for tpu5 are the same lines (milo has no other VM).
    assert config.endswith("\n" + preview + "\n")
    assert emailed == preview
    assert emailed_known == known
    hosts = [line.split()[1] for line in preview.splitlines() if line.startswith("Host ")]
    assert hosts == ["tpu5", "tpu5-w0", "tpu5-w1"]
    # Each block says, in ssh's own words, where its host keys are.
    for host in hosts:
        for text in (config, preview, emailed):
            seen = _resolved(scene.laptop, text, host)
            assert (
                seen["userknownhostsfile"]
                == f"{scene.laptop.real_home}/.ssh/tpu-portal_known_hosts"
            )
            assert seen["stricthostkeychecking"] in {"true", "yes"}
            assert seen["hostkeyalias"].startswith("tpu-portal.vision.tpu5.w")


def test_the_files_where_the_page_says_make_plain_ssh_work_from_any_directory(scene, client):
    laptop, username = scene.laptop, scene.milo.unix_account.username
    client.force_login(scene.milo)
    _download(client, laptop)
    laptop.path("~/.ssh/config").write_text("Host github.com\n    User git\n")  # his own
    page = client.get("/ssh/").content.decode()
    # The page's commands, pasted as they are, put both files in place.
    installed = laptop.shell(_page_pre(page, "ssh-install"))
    assert installed.returncode == 0, installed.stderr
    assert laptop.path(CONFIG).is_file() and laptop.path(KNOWN).is_file()
    assert laptop.path("~/.ssh/config").read_text().startswith("Include config.d/*\n")
    assert "Host github.com" in laptop.path("~/.ssh/config").read_text()

    for cwd in ("/", "/tmp", laptop.real_home):
        result = laptop.ssh("tpu5", "id -un", cwd=cwd)
        assert result.returncode == 0, (cwd, result.stderr)
        assert result.stdout.strip() == username
    # The config alone, given with -F, from anywhere, and a copy of it elsewhere.
    shutil.copy(laptop.path(CONFIG), laptop.root / "Downloads" / "copy")
    for config in (CONFIG.replace("~", laptop.real_home), f"{laptop.real_home}/Downloads/copy"):
        result = laptop.ssh("-F", config, "tpu5-w1", "hostname", cwd="/tmp")
        assert result.returncode == 0, (config, result.stderr)
    # Strict checking is on: a wrong key for the worker is refused, not learned.
    laptop.path(KNOWN).write_text(
        laptop.path(KNOWN).read_text().replace("tpu-portal.vision.tpu5.w0", "tpu-portal.x.w0")
    )
    assert laptop.ssh("tpu5", "true").returncode != 0


def test_without_the_host_keys_the_person_is_told_which_file_is_missing(scene, client):
    laptop = scene.laptop
    client.force_login(scene.milo)
    config, _ = _download(client, laptop)
    laptop.path(CONFIG).parent.mkdir(parents=True)
    shutil.copy(laptop.path("~/Downloads/tpu-portal"), laptop.path(CONFIG))
    # known_hosts stays in ~/Downloads: not where the config reads it.

    result = laptop.ssh("-F", CONFIG.replace("~", laptop.real_home), "tpu5", "true")
    assert result.returncode != 0
    # ssh names the host key alias, never the file ...
    said = re.search(r"No \S+ host key is known for (tpu-portal\.vision\.tpu5\.w0)", result.stderr)
    assert said, result.stderr
    assert "Host key verification failed" in result.stderr
    # ... so the config names it right above the Host block ssh read, and in its header,
    lines = config.splitlines()
    above = lines[lines.index("Host tpu5") - 1]
    assert above.startswith("#") and KNOWN in above and "/ssh/" in above
    assert any(KNOWN in line for line in lines[:6] if line.startswith("#"))
    # ... and the page quotes ssh's words and says where the file goes.
    page = client.get("/ssh/").content.decode()
    help_text = html.unescape(re.search(r'id="ssh-known-hosts-help"[^>]*>(.*?)</p>', page, re.S)[1])
    assert "host key is known for tpu-portal." in help_text and KNOWN in help_text
    assert "Host key verification failed" in help_text

    # Put where the config says, the same file makes it work.
    shutil.copy(laptop.path("~/Downloads/tpu-portal_known_hosts"), laptop.path(KNOWN))
    again = laptop.ssh("-F", CONFIG.replace("~", laptop.real_home), "tpu5", "true")
    assert again.returncode == 0, again.stderr


def test_the_emailed_lines_alone_log_in_with_pinned_host_keys(scene):
    """Someone who only reads the email and pastes its two parts where it says."""
    laptop = scene.laptop
    [email] = [m for m in mail.outbox if m.to == ["milo@uni.example"]]
    blocks, known = _email_parts(email.body)
    assert "Then log in with:  ssh tpu5\n" in email.body
    laptop.path("~/.ssh/config").write_text(blocks + "\n")
    laptop.path(KNOWN).write_text(known)
    result = laptop.ssh("tpu5", "id -un")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == scene.milo.unix_account.username

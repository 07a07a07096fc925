"""Port forwards on the ssh page: the exact ``ssh -N -L`` line for chosen ports, and
``LocalForward`` lines kept in the VM's Host block of the config. Bad ports get a
clear reason and store nothing; the real forwarding is tested on the fleet below."""

from __future__ import annotations

import time
import urllib.request
from urllib.parse import urlparse

import pytest
from django.urls import reverse

from accounts.unix import choose_username
from tpus.models import Grant, PortForward, TpuVm, Worker
from tpus.services import sshconfig

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def milo(make_user, make_lab, add_member):
    user = make_user("milo@uni.example")
    lab = make_lab("Vision", slug="vision")
    add_member(lab, user)
    for name, ips in (("tpu5", ["34.0.0.1", "34.0.0.2"]), ("tpu6", ["34.0.0.3"])):
        vm = TpuVm.objects.create(lab=lab, name=name, zone="us-central1-f", source="manual")
        for index, ip in enumerate(ips):
            Worker.objects.create(vm=vm, index=index, external_ip=ip, host_keys=[])
        Grant.objects.create(user=user, vm=vm, state="active")
    choose_username(user, "milo")
    return type(user).objects.get(pk=user.pk)


def _vm(name):
    return TpuVm.objects.get(name=name)


def _post(client, vm, action, local, remote):
    url = reverse("ssh_forward", args=[vm.pk])
    data = {"action": action, "local_port": local, "remote_port": remote}
    return client.post(url, data, **HTMX).content.decode()


def _block(config: str, host: str) -> list[str]:
    lines = config.splitlines()
    start = lines.index(f"Host {host}")
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return block


def test_the_line_is_the_exact_ssh_command_for_the_chosen_ports(client, milo):
    client.force_login(milo)
    box = _post(client, _vm("tpu5"), "line", "16006", "6006")
    assert "ssh -N -L 16006:localhost:6006 tpu5</pre>" in box
    assert PortForward.objects.count() == 0  # showing a line keeps nothing


@pytest.mark.parametrize(
    ("local", "remote", "reason"),
    [
        ("", "6006", "Enter the local port"),
        ("6006", "", "Enter the remote port"),
        ("abc", "6006", "The local port must be a whole number from 1024 to 65535"),
        ("6006.0", "6006", "The local port must be a whole number"),
        ("-6006", "6006", "The local port must be a whole number"),
        ("６００６", "6006", "The local port must be a whole number"),
        ("6006", "1e4", "The remote port must be a whole number"),
        ("80", "6006", "The local port must be from 1024 to 65535, not 80"),
        ("6006", "1023", "The remote port must be from 1024 to 65535, not 1023"),
        ("65536", "6006", "The local port must be from 1024 to 65535, not 65536"),
        ("6006", "99999", "The remote port must be from 1024 to 65535, not 99999"),
    ],
)
@pytest.mark.parametrize("action", ["line", "add"])
def test_bad_ports_are_refused_with_the_reason_and_nothing_is_stored(
    client, milo, action, local, remote, reason
):
    client.force_login(milo)
    box = _post(client, _vm("tpu5"), action, local, remote)
    assert 'class="errorlist" role="alert"' in box
    assert reason in box
    assert "ssh -N" not in box
    assert PortForward.objects.count() == 0
    assert "LocalForward" not in client.get("/ssh/config").content.decode()


def test_added_forwards_go_into_that_vms_host_block_only(client, milo):
    client.force_login(milo)
    _post(client, _vm("tpu5"), "add", "16006", "6006")
    box = _post(client, _vm("tpu5"), "add", " 18888 ", "8888")
    assert "LocalForward 18888 localhost:8888" in box
    assert "ssh -N tpu5</pre>" in box  # what opens just the forwards
    config = client.get("/ssh/config").content.decode()
    assert _block(config, "tpu5")[-2:] == [
        "LocalForward 16006 localhost:6006",
        "LocalForward 18888 localhost:8888",
    ]
    for other in ("tpu5-w0", "tpu5-w1", "tpu6"):
        assert not any(line.startswith("LocalForward") for line in _block(config, other))
    # The page's preview and the refresh URL give the same lines.
    assert "LocalForward 18888 localhost:8888" in client.get("/ssh/").context["snippet"]
    sshconfig.rotate_feed(milo)
    feed = urlparse(sshconfig.feed_urls(milo)["config"]).path
    client.logout()
    assert _block(client.get(feed).content.decode(), "tpu5") == _block(config, "tpu5")


def test_a_local_port_already_forwarded_in_that_block_is_refused_by_name(client, milo):
    client.force_login(milo)
    tpu5 = _vm("tpu5")
    _post(client, tpu5, "add", "16006", "6006")
    clash = _post(client, tpu5, "add", "16006", "8888")
    assert "Local port 16006 is already forwarded to port 6006 on tpu5 in your ssh config" in clash
    line = _post(client, tpu5, "line", "16006", "8888")
    assert "Local port 16006 is already forwarded to port 6006 on tpu5" in line
    same = _post(client, tpu5, "line", "16006", "6006")
    assert "already forwards local port 16006 to port 6006 on tpu5" in same
    assert "plain `ssh -N tpu5` opens it" in same
    assert list(PortForward.objects.values_list("local_port", "remote_port")) == [(16006, 6006)]
    # Asking for the same forward again is fine and keeps one; another VM may reuse the port.
    _post(client, tpu5, "add", "16006", "6006")
    _post(client, _vm("tpu6"), "add", "16006", "8888")
    assert PortForward.objects.filter(local_port=16006).count() == 2


def test_a_forward_can_be_removed(client, milo):
    client.force_login(milo)
    tpu5 = _vm("tpu5")
    _post(client, tpu5, "add", "16006", "6006")
    url = reverse("ssh_forward_remove", args=[tpu5.pk, 16006])
    box = client.post(url, **HTMX).content.decode()
    assert "LocalForward" not in box
    assert not PortForward.objects.exists()
    assert client.post(url, **HTMX).status_code == 200  # already gone is fine


def test_without_htmx_the_page_says_it_after_a_redirect(client, milo):
    client.force_login(milo)
    url = reverse("ssh_forward", args=[_vm("tpu5").pk])
    bad = client.post(
        url, {"action": "add", "local_port": "80", "remote_port": "6006"}, follow=True
    )
    assert "The local port must be from 1024 to 65535, not 80" in bad.content.decode()
    good = client.post(url, {"action": "line", "local_port": "16006", "remote_port": "6006"})
    assert good.status_code == 302
    page = client.get(good["Location"]).content.decode()
    assert "ssh -N -L 16006:localhost:6006 tpu5" in page


def test_someone_elses_vm_is_a_404_and_gets_no_forward(client, milo, make_user, make_lab):
    ada = make_user("ada@other.example")
    client.force_login(ada)
    response = client.post(
        reverse("ssh_forward", args=[_vm("tpu5").pk]),
        {"action": "add", "local_port": "16006", "remote_port": "6006"},
    )
    assert response.status_code == 404
    assert not PortForward.objects.exists()


def test_a_clashing_vm_name_gets_the_lab_prefixed_host_in_the_line(
    client, milo, make_lab, add_member
):
    speech = make_lab("Speech", slug="speech")
    add_member(speech, milo)
    vm = TpuVm.objects.create(lab=speech, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="34.0.0.9", host_keys=[])
    Grant.objects.create(user=milo, vm=vm, state="active")
    client.force_login(milo)
    assert "ssh -N -L 16006:localhost:6006 speech-tpu5</pre>" in _post(
        client, vm, "line", "16006", "6006"
    )


# --- Real forwarding through the fleet -------------------------------------------------


@pytest.mark.fleet
def test_the_line_and_the_config_forward_to_a_server_on_the_vm(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, client, django_capture_on_commit_callbacks,
):  # fmt: skip
    import shlex

    from accounts.keys import add_key
    from accounts.models import User
    from testfleet.fixtures import add_fleet_node, give_lab_key
    from tests.e2e import free_port
    from tests.laptop import Laptop, new_key
    from tpus.services import inventory
    from tpus.services.grants import grant_access

    [host] = fleet_hosts(1)
    lab = make_lab("Vision", slug="vision", gcp_project_id="vision-lab-1", zones=["us-central1-f"])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, [host], "vision-lab-1", "us-central1-f", "tpu5")
    give_lab_key(fleet, [host], lab)
    [vm] = inventory.import_vms(admin, lab, ["us-central1-f/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    laptop = Laptop(tmp_path / "home")
    add_key(milo, new_key(laptop))
    milo = User.objects.select_related("unix_account").get(pk=milo.pk)
    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "active", grant.error

    # Milo's dashboard on the VM: a web server on localhost only, started as him.
    uid, home = milo.unix_account.uid, f"/home/{fleet_username}"
    remote = 20_000 + uid % 10_000
    started = fleet.exec(
        host.name,
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "sh", "-c",
         f"cd {home} && echo 'served on tpu5' > board.txt && "
         f"nohup python3 -m http.server {remote} --bind 127.0.0.1 >/dev/null 2>&1 & echo $!"],
    )  # fmt: skip
    server_pid = started.stdout.decode().strip()
    client.force_login(milo)
    tunnels = []
    try:
        # The files where the page says.
        laptop.path(sshconfig.CONFIG_PATH).parent.mkdir(parents=True)
        laptop.path("~/.ssh/config").write_text("Include config.d/*\n")

        def install():
            for url, path in (("/ssh/config", sshconfig.CONFIG_PATH),
                              ("/ssh/known_hosts", sshconfig.KNOWN_HOSTS_PATH)):  # fmt: skip
                laptop.path(path).write_bytes(client.get(url).content)

        def fetch(port: int) -> str:
            deadline, error = time.monotonic() + 20, None
            while time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/board.txt", timeout=3
                    ) as r:
                        return r.read().decode()
                except OSError as exc:
                    error = exc
                    time.sleep(0.2)
            raise AssertionError(f"nothing answered on 127.0.0.1:{port}: {error}")

        # 1. The line from the page, run as it is.
        install()
        local = free_port()
        box = _post(client, vm, "line", str(local), str(remote))
        line = box.split('<pre class="forward-line">', 1)[1].split("</pre>", 1)[0]
        assert line == f"ssh -N -L {local}:localhost:{remote} tpu5"
        tunnels.append(laptop.start(shlex.split(line)))
        assert fetch(local) == "served on tpu5\n"

        # 2. The forward kept in the config: any login to tpu5 opens it.
        kept = free_port()
        _post(client, vm, "add", str(kept), str(remote))
        install()
        tunnels.append(laptop.start(["ssh", "-N", "tpu5"], cwd="/tmp"))
        assert fetch(kept) == "served on tpu5\n"
    finally:
        for tunnel in tunnels:
            tunnel.terminate()
            tunnel.wait(timeout=10)
        fleet.exec(host.name, ["kill", server_pid], check=False)

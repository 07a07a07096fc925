"""``/me/ssh-hosts``: the person's ssh hosts as data, from which the ``tpu`` client
writes the config and known_hosts itself. What the client writes from it sends ssh
to the same places, with the same keys, as the config the portal's page gives."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tpu_cli import sshbuild

from accounts.unix import choose_username
from tests.requirements import need
from tpus.models import ConfigFeed, Grant, PortForward, TpuVm, Worker
from tpus.services import sshconfig

KEYS = [
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBsUNpVxUoLRKFRWhlc1fVBJdrTzbdMdQCmwUIcS6PxM",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl",
]


def _vm(lab, name, zone, ips):
    vm = TpuVm.objects.create(lab=lab, name=name, zone=zone, source="manual")
    for index, ip in enumerate(ips):
        Worker.objects.create(vm=vm, index=index, external_ip=ip, host_keys=[KEYS[index % 2]])
    return vm


def _effective(config: Path, host: str) -> dict:
    out = subprocess.run(["ssh", "-G", "-F", str(config), host], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    found = dict(line.partition(" ")[::2] for line in out.splitlines())
    return {key: found.get(key) for key in (
        "hostname", "user", "hostkeyalias", "stricthostkeychecking", "forwardagent",
        "localforward",
    )}  # fmt: skip


def test_the_clients_config_from_the_data_matches_the_portals(
    client, make_user, make_lab, add_member, tmp_path
):
    need(shutil.which("ssh") is not None, "needs OpenSSH's ssh client")
    milo = make_user("milo@uni.example")
    vision, nlp = make_lab("Vision", slug="vision"), make_lab("NLP", slug="nlp")
    add_member(vision, milo)
    add_member(nlp, milo)
    pod = _vm(vision, "tpu5", "us-central1-f", ["10.1.0.1", "10.1.0.2", ""])
    other = _vm(nlp, "tpu5", "us-central1-f", ["10.2.0.1"])
    zones = (("us-central1-f", "10.3.0.1"), ("europe-west4-a", "10.4.0.1"))
    zoned = [_vm(nlp, "v2", zone, [ip]) for zone, ip in zones]
    for vm in (pod, other, *zoned):
        Grant.objects.create(user=milo, vm=vm, state="active")
    PortForward.objects.create(user=milo, vm=pod, local_port=16006, remote_port=6006)
    ConfigFeed.objects.create(user=milo, salt="x", forward_agent=True)
    choose_username(milo, "milo")
    client.force_login(milo)

    answer = client.get("/api/v1/me/ssh-hosts").json()

    assert answer["username"] == "milo"
    [data] = [vm for vm in answer["vms"] if vm["lab"] == "vision"]
    assert data["host"] == "vision-tpu5" and data["forwards"] == [{"local": 16006, "remote": 6006}]
    alias = "tpu-portal.vision.tpu5.w2"
    assert data["workers"][2] == {
        "index": 2,
        "address": None,
        "alias": alias,
        "host_keys": [KEYS[0]],
    }
    known = tmp_path / "known_hosts"
    built = sshbuild.build(answer, "https://tpu.example.edu", known)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.write_text(built.config)
    milo = type(milo).objects.get(pk=milo.pk)
    theirs.write_text(sshconfig.render_config(milo))
    hosts = ["vision-tpu5", "vision-tpu5-w0", "vision-tpu5-w1", "nlp-tpu5",
             "v2-us-central1-f", "v2-europe-west4-a"]  # fmt: skip
    for host in hosts:
        assert _effective(mine, host) == _effective(theirs, host), host
        assert _effective(mine, host)["hostname"] != host  # the host is in both
    assert _effective(mine, "vision-tpu5")["localforward"] == "16006 [localhost]:6006"
    assert built.known_hosts == sshconfig.render_known_hosts(sshconfig.vms_for(milo))


def test_without_a_unix_username_there_are_no_hosts(client, make_user):
    milo = make_user("milo@uni.example")
    client.force_login(milo)
    assert client.get("/api/v1/me/ssh-hosts").json() == {"username": None, "vms": []}

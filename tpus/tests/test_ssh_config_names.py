"""Every VM a person can reach gets its own ``Host`` name and ``HostKeyAlias`` in the
ssh config, known_hosts, the page and the emails, even when two share a name."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from django.core import mail

from accounts.unix import choose_username
from tests.requirements import need
from tpus.models import Grant, TpuVm, Worker
from tpus.services import sshconfig
from tpus.tasks import send_grant_email


def _vm(lab, name, zone, ips, key_prefix):
    vm = TpuVm.objects.create(lab=lab, name=name, zone=zone, source="manual")
    for index, ip in enumerate(ips):
        Worker.objects.create(
            vm=vm, index=index, external_ip=ip, host_keys=[f"ssh-ed25519 AAAA{key_prefix}{index}"]
        )
    return vm


@pytest.fixture
def milo(make_user, make_lab, add_member):
    def build(*vm_specs):
        user = make_user("milo@uni.example")
        labs = {}
        for lab_slug, name, zone, ips, key_prefix in vm_specs:
            if lab_slug not in labs:
                labs[lab_slug] = make_lab(lab_slug.title(), slug=lab_slug)
                add_member(labs[lab_slug], user)
            vm = _vm(labs[lab_slug], name, zone, ips, key_prefix)
            Grant.objects.create(user=user, vm=vm, state="active")
        choose_username(user, "milo")
        return type(user).objects.get(pk=user.pk)

    return build


def _resolve(tmp_path, user, *hosts):
    need(shutil.which("ssh") is not None, "needs OpenSSH's ssh client (apt install openssh-client)")
    config = tmp_path / "config"
    config.write_text(sshconfig.render_config(user))
    found = {}
    for host in hosts:
        out = subprocess.run(
            ["ssh", "-G", "-F", str(config), host], capture_output=True, text=True, check=True
        ).stdout
        fields = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        found[host] = (fields["hostname"], fields["hostkeyalias"])
    return found


def _known_hosts(user):
    lines = sshconfig.render_known_hosts(sshconfig.vms_for(user)).splitlines()
    return {line.split()[0]: " ".join(line.split()[1:]) for line in lines}


def test_two_vms_with_one_name_in_two_zones_resolve_to_their_own_workers(milo, tmp_path):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1"], "F"),
        ("vision", "tpu5", "europe-west4-a", ["34.0.0.2"], "E"),
    )
    assert _resolve(tmp_path, user, "tpu5-us-central1-f", "tpu5-europe-west4-a") == {
        "tpu5-us-central1-f": ("34.0.0.1", "tpu-portal.vision.tpu5.us-central1-f.w0"),
        "tpu5-europe-west4-a": ("34.0.0.2", "tpu-portal.vision.tpu5.europe-west4-a.w0"),
    }
    assert _known_hosts(user) == {
        "tpu-portal.vision.tpu5.us-central1-f.w0": "ssh-ed25519 AAAAF0",
        "tpu-portal.vision.tpu5.europe-west4-a.w0": "ssh-ed25519 AAAAE0",
    }


def test_two_labs_tpu5_keep_their_lab_prefixed_names_and_own_aliases(milo, tmp_path):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1"], "V"),
        ("speech", "tpu5", "us-central1-f", ["34.0.0.2"], "S"),
    )
    assert _resolve(tmp_path, user, "vision-tpu5", "speech-tpu5") == {
        "vision-tpu5": ("34.0.0.1", "tpu-portal.vision.tpu5.w0"),
        "speech-tpu5": ("34.0.0.2", "tpu-portal.speech.tpu5.w0"),
    }
    assert set(_known_hosts(user)) == {"tpu-portal.vision.tpu5.w0", "tpu-portal.speech.tpu5.w0"}


def test_unique_names_keep_todays_hosts_and_aliases(milo, tmp_path):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1", "34.0.0.3"], "A"),
        ("vision", "tpu6", "europe-west4-a", ["34.0.0.2"], "B"),
    )
    assert _resolve(tmp_path, user, "tpu5", "tpu5-w1", "tpu6") == {
        "tpu5": ("34.0.0.1", "tpu-portal.vision.tpu5.w0"),
        "tpu5-w1": ("34.0.0.3", "tpu-portal.vision.tpu5.w1"),
        "tpu6": ("34.0.0.2", "tpu-portal.vision.tpu6.w0"),
    }


def test_a_pod_sharing_a_name_gets_zone_qualified_worker_hosts(milo, tmp_path):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1", "34.0.0.3"], "F"),
        ("vision", "tpu5", "europe-west4-a", ["34.0.0.2"], "E"),
    )
    resolved = _resolve(tmp_path, user, "tpu5-us-central1-f-w1")
    assert resolved["tpu5-us-central1-f-w1"] == (
        "34.0.0.3",
        "tpu-portal.vision.tpu5.us-central1-f.w1",
    )


def test_a_generated_name_never_clashes_with_another_vms_own_name(milo):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1"], "F"),
        ("vision", "tpu5", "europe-west4-a", ["34.0.0.2"], "E"),
        ("vision", "tpu5-us-central1-f", "us-east1-d", ["34.0.0.3"], "X"),
    )
    config = sshconfig.render_config(user)
    hosts = [line.split()[1] for line in config.splitlines() if line.startswith("Host ")]
    assert len(hosts) == len(set(hosts)) == 3
    assert "tpu5-us-central1-f" in hosts  # the VM that really has that name keeps it


def test_the_names_do_not_depend_on_the_order_of_the_vms(milo):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1"], "F"),
        ("vision", "tpu5", "europe-west4-a", ["34.0.0.2"], "E"),
    )
    vms = sshconfig.vms_for(user)
    assert sshconfig.names_for(vms) == sshconfig.names_for(list(reversed(vms)))


def test_the_grant_email_and_the_page_use_the_zone_qualified_name(
    milo, client, django_capture_on_commit_callbacks
):
    user = milo(
        ("vision", "tpu5", "us-central1-f", ["34.0.0.1"], "F"),
        ("vision", "tpu5", "europe-west4-a", ["34.0.0.2"], "E"),
    )
    grant = Grant.objects.get(vm__zone="europe-west4-a")
    with django_capture_on_commit_callbacks(execute=True):
        send_grant_email(grant.pk, "active")
    [email] = mail.outbox
    assert "Host tpu5-europe-west4-a\n" in email.body
    assert "HostKeyAlias tpu-portal.vision.tpu5.europe-west4-a.w0" in email.body
    assert "Host tpu5\n" not in email.body
    client.force_login(user)
    snippet = client.get("/ssh/").context["snippet"]
    assert "Host tpu5-us-central1-f\n" in snippet and "Host tpu5-europe-west4-a\n" in snippet

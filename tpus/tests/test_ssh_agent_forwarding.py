"""Agent forwarding on the ssh page: the person's own choice or the lab's default goes
into every Host block, and while it is on, the page names who else can use sudo on
each VM (they could use the agent while the person is logged in)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from accounts.unix import choose_username
from tpus.models import Grant, Lab, TpuVm, Worker

WARNING = "can use sudo: with forwarding on, they could use your agent"


@pytest.fixture
def milo(make_user, make_lab, add_member):
    """Milo on tpu5 and tpu6; Ada has sudo on tpu6, Bo on tpu5, Cy only a plain login."""
    lab = make_lab("Vision", slug="vision")
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, "milo")
    vms = {}
    for name in ("tpu6", "tpu5"):
        vm = vms[name] = TpuVm.objects.create(
            lab=lab, name=name, zone="us-central1-f", source="manual"
        )
        Worker.objects.create(vm=vm, index=0, external_ip="34.0.0.1")
        Grant.objects.create(user=milo, vm=vm, state="active")
    for who, vm, sudo in (("ada", "tpu6", True), ("bo", "tpu5", True), ("cy", "tpu5", False)):
        user = make_user(f"{who}@uni.example")
        add_member(lab, user)
        choose_username(user, who)
        Grant.objects.create(user=user, vm=vms[vm], state="active", sudo=sudo)
    return milo


def _choose(client, choice):
    assert client.post(reverse("ssh_forwarding"), {"forward_agent": choice}).status_code == 302
    return client.get(reverse("ssh_page")).content.decode()


def test_with_forwarding_on_the_page_names_who_has_sudo_on_each_vm_in_order(client, milo):
    client.force_login(milo)
    page = _choose(client, "yes")
    assert "    ForwardAgent yes" in page
    first = page.index(f"On tpu5, bo {WARNING}")
    assert first < page.index(f"On tpu6, ada {WARNING}")
    assert page.count(WARNING) == 2  # cy has no sudo, and milo is not named


def test_with_forwarding_off_there_is_nothing_to_warn_about(client, milo):
    client.force_login(milo)
    page = _choose(client, "no")
    assert "    ForwardAgent no" in page and "ForwardAgent yes" not in page
    assert WARNING not in page


def test_the_labs_default_applies_until_the_person_chooses(client, milo):
    Lab.objects.filter(slug="vision").update(default_agent_forwarding=True)
    client.force_login(milo)
    assert WARNING in client.get(reverse("ssh_page")).content.decode()
    assert WARNING not in _choose(client, "no")
    assert WARNING in _choose(client, "lab")

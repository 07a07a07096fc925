"""Agent forwarding on the ssh page: only the person's own choice turns it on in their
Host blocks (any sudoer on a VM can use a forwarded agent, so no lab admin can switch
it on for the members), and while it is on, the page names who else can use sudo on
each VM (they could use the agent while the person is logged in)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
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


def test_forwarding_is_off_until_the_person_turns_it_on(client, milo):
    client.force_login(milo)
    page = client.get(reverse("ssh_page")).content.decode()
    assert "    ForwardAgent no" in page and "ForwardAgent yes" not in page
    assert WARNING not in page
    assert "lab's default" not in page
    assert "ForwardAgent yes" in _choose(client, "yes")


def test_a_choice_other_than_yes_or_no_changes_nothing(client, milo):
    client.force_login(milo)
    _choose(client, "yes")
    response = client.post(reverse("ssh_forwarding"), {"forward_agent": "lab"}, follow=True)
    assert "Choose whether to forward your agent" in response.content.decode()
    assert "    ForwardAgent yes" in client.get(reverse("ssh_page")).content.decode()


def test_a_lab_admin_cannot_switch_forwarding_on_for_the_members(client, milo, make_user):
    from tpus.models import Membership

    lab = Lab.objects.get(slug="vision")
    admin = make_user("boss@uni.example")
    Membership.objects.create(
        lab=lab, user=admin, role="admin", state="approved",
        policy_version_accepted=lab.policy_version,
    )  # fmt: skip
    client.force_login(admin)
    refused = client.patch(
        f"/api/v1/labs/{lab.slug}/settings",
        {"default_agent_forwarding": True},
        content_type="application/json",
    )
    assert refused.status_code == 422
    assert "default_agent_forwarding" in refused.content.decode()
    form = client.get(reverse("lab_settings", args=[lab.slug])).content.decode()
    assert "forwarding" not in form.lower()
    client.post(
        reverse("lab_settings", args=[lab.slug]),
        {"name": lab.name, "default_agent_forwarding": "on", "discoverable": "on",
         "policy_text": lab.policy_text},
    )  # fmt: skip
    client.force_login(milo)
    page = client.get(reverse("ssh_page")).content.decode()
    assert "    ForwardAgent no" in page and "ForwardAgent yes" not in page


@pytest.mark.django_db(transaction=True)
def test_upgrading_turns_no_ones_forwarding_on_and_keeps_each_persons_choice(make_user):
    from django.core.management import call_command

    executor = MigrationExecutor(connection)
    key = next(
        k for k in executor.loader.graph.nodes
        if k[0] == "tpus" and k[1].endswith("_agent_forwarding_is_each_persons_own")
    )  # fmt: skip
    [before] = [p.key for p in executor.loader.graph.node_map[key].parents if p.key[0] == "tpus"]
    try:
        executor.migrate([before])
        old = MigrationExecutor(connection).loader.project_state([before]).apps
        OldLab, Feed = old.get_model("tpus", "Lab"), old.get_model("tpus", "ConfigFeed")
        OldLab.objects.create(
            name="Old", slug="old", gcp_project_id="old-project", default_agent_forwarding=True
        )
        chose, never = make_user(), make_user()
        Feed.objects.create(user_id=chose.pk, salt="a", forward_agent=True)
        Feed.objects.create(user_id=never.pk, salt="b", forward_agent=None)

        MigrationExecutor(connection).migrate([key])

        from tpus.models import ConfigFeed
        from tpus.services.sshconfig import forward_agent

        assert ConfigFeed.objects.get(user=chose).forward_agent is True
        assert ConfigFeed.objects.get(user=never).forward_agent is None
        # The table is as that migration left it: columns later ones add are not there.
        vm = TpuVm(lab=Lab.objects.only("pk").get(slug="old"), name="x")
        assert forward_agent(never, vm) is False and forward_agent(chose, vm) is True
    finally:
        call_command("migrate", verbosity=0)

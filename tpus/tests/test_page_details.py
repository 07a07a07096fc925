"""Details of the admins' pages that a person trying the demo tripped on: the requests
to join as a list on a phone, a date field beside its label, one state per grant on
the access page, sentences without stray punctuation, "Connect this VM" only where it
is the thing to do, and the authenticator page saying why it is asked for. Layout at
375 px is checked in a browser by tests/test_journey_a11y.py."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.unix import choose_username
from tpus.models import ConnectionState, Grant, TpuVm, VmConnection, Worker

pytestmark = pytest.mark.django_db


def _vm(lab, **fields) -> TpuVm:
    vm = TpuVm.objects.create(lab=lab, name="tpu5", zone="us-central1-f", **fields)
    Worker.objects.create(vm=vm, index=0, external_ip="10.213.0.9", host_keys=["ssh-ed25519 AAAA"])
    return vm


def _section(body: str, marker: str) -> str:
    start = body.index(marker)
    return body[start : body.index("</section>", start)]


def test_requests_to_join_are_a_list_whose_cells_say_what_they_are(client, cast):
    client.force_login(cast.admin)
    body = client.get(reverse("lab_admin", args=[cast.lab.slug])).content.decode()
    requests = _section(body, 'id="requests"')
    assert '<table class="stack" id="request-list">' in requests
    row = requests[requests.index(f'id="membership-{cast.pending_membership.pk}"') :]
    for label in ("Who", "Purpose", "Asked"):
        assert f'data-label="{label}"' in row
    assert '<td class="actions">' in row and ">Approve</button>" in row
    assert 'aria-label="Reason for rejecting pat@vision.example (optional)"' in row


def test_the_member_forms_date_field_sits_with_its_label(client, cast):
    choose_username(cast.member, "milo")
    client.force_login(cast.admin)
    url = reverse("member_grant", args=[cast.lab.slug, cast.member_membership.pk])
    body = client.get(url).content.decode()
    together = re.search(r'<span class="labelled" id="grant-until">(.*?)</span>', body, re.S)
    assert together, body
    assert "until (optional)</label>" in together[1] and 'type="date"' in together[1]


def test_a_grant_shows_one_state_on_the_access_page_as_it_changes(client, cast):
    choose_username(cast.member, "milo")
    vm = _vm(cast.lab, source="manual")
    grant = Grant.objects.create(user=cast.member, vm=vm, state="pending")
    client.force_login(cast.admin)
    page = client.get(reverse("vm_access", args=[cast.lab.slug, vm.pk])).content.decode()
    assert f'<span id="access-state-{grant.pk}"><span class="badge pending">' in page

    Grant.objects.filter(pk=grant.pk).update(state="active", activated_at=timezone.now())
    progress = client.get(
        reverse("vm_progress", args=[cast.lab.slug, vm.pk]), HTTP_HX_REQUEST="true"
    ).content.decode()
    # The row under "Who has access" is swapped with the new state, out of band.
    assert (
        f'<span id="access-state-{grant.pk}" hx-swap-oob="true">'
        '<span class="badge active">Active</span></span>'
    ) in progress


def test_the_reasons_nobody_can_be_given_access_are_a_list_without_stray_punctuation(client, cast):
    vm = _vm(cast.lab, source="manual")
    client.force_login(cast.admin)
    body = client.get(reverse("vm_access", args=[cast.lab.slug, vm.pk])).content.decode()
    start = body.index('id="grant-readiness"')
    readiness = body[start : body.index("</div>", start)]
    assert "<strong>No member can be given access yet.</strong>" in readiness
    assert "Not yet:</p>" in readiness
    items = re.findall(r"<li>(.*?)</li>", readiness, re.S)
    assert len(items) == 2, readiness  # a request, and two members without a username
    text = re.sub(r"<[^>]+>", "", readiness)
    assert ";" not in text and ":." not in text and ".." not in text


@pytest.mark.parametrize(
    ("state", "button"),
    [
        (ConnectionState.DISCONNECTED, '<button type="submit">Connect this VM</button>'),
        (ConnectionState.FAILED, '<button type="submit">Connect this VM</button>'),
        (ConnectionState.CONNECTED, '<button type="submit" class="secondary" title='),
    ],
)
def test_connect_this_vm_is_the_primary_button_only_on_a_vm_not_connected(
    client, cast, state, button
):
    vm = _vm(cast.lab, source="imported")
    VmConnection.objects.create(vm=vm, state=state)
    client.force_login(cast.admin)
    body = client.get(reverse("vm_detail", args=[cast.lab.slug, vm.pk])).content.decode()
    assert button in body
    if state == ConnectionState.CONNECTED:
        assert "Connect this VM" not in body and ">Connect again</button>" in body


def _totp_page(client, user) -> str:
    client.post(
        reverse("account_login"), {"login": user.email, "password": "correct horse battery"}
    )
    return client.get(reverse("mfa_activate_totp")).content.decode()


def test_the_authenticator_page_says_why_an_admin_must_set_it_up_in_one_form(
    client, cast, settings
):
    settings.PORTAL_REQUIRE_ADMIN_MFA = True
    body = _totp_page(client, cast.admin)
    assert 'id="why-totp"' in body and "You run a lab here" in body
    assert "shell access, with sudo, to the lab&#x27;s TPU VMs" in body or (
        "shell access, with sudo, to the lab's TPU VMs" in body
    )
    forms = re.findall(r"<form\b.*?</form>", body, re.S)
    [activate] = [f for f in forms if 'action="/accounts/2fa/totp/activate/"' in f]
    assert activate.count('name="csrfmiddlewaretoken"') == 1
    assert body.count('name="csrfmiddlewaretoken"') == len(forms)


def test_a_member_setting_up_an_app_by_choice_is_not_told_it_is_required(client, cast, settings):
    settings.PORTAL_REQUIRE_ADMIN_MFA = True
    body = _totp_page(client, cast.member)
    assert "Activate Authenticator App" in body and 'id="why-totp"' not in body

"""The "Give access" picker in a real browser, by keyboard only: the admin types part
of a name, moves through the matches with the arrow keys, chooses with Enter, submits
with Enter, and the grant exists. The reconcile that would follow is not this test's
subject: it is recorded, not run."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from accounts.models import UnixAccount
from accounts.tests.keydata import ED25519
from tpus import queue
from tpus.models import Grant, TpuVm, Worker

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)


def _member(lab, make_user, add_member, email, username, uid):
    user = make_user(email, password=PASSWORD)
    add_member(lab, user)
    UnixAccount.objects.create(user=user, username=username, uid=uid)
    return user


def _on_the_access_page_of_tpu5(page, make_lab, make_user, add_member):
    """Vision Lab's admin, signed in, on tpu5's Access page; mila and milo are members
    with usernames. Returns tpu5 and milo."""
    lab = make_lab("Vision Lab", slug="vision")
    add_member(lab, make_user("boss@vision.example", password=PASSWORD), role="admin")
    vm = TpuVm.objects.create(lab=lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10", host_keys=[ED25519])
    _member(lab, make_user, add_member, "mila@uni.example", "mila", 30_001)
    milo = _member(lab, make_user, add_member, "milo@uni.example", "milo", 30_002)

    page.goto("/accounts/login/")
    page.fill("input[name=login]", "boss@vision.example")
    page.fill("input[name=password]", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    page.goto(f"/labs/{lab.slug}/vms/{vm.pk}/access/")
    return vm, milo


def test_an_admin_gives_access_with_the_picker_using_only_the_keyboard(
    page, live_server, make_lab, make_user, add_member, monkeypatch
):
    reconciles = []
    monkeypatch.setattr(queue, "reconcile_vm", reconciles.append)
    # Someone of another lab with a matching name never shows up.
    other = make_lab("Other Lab", slug="other")
    _member(other, make_user, add_member, "miles@other.example", "miles", 30_003)
    vm, milo = _on_the_access_page_of_tpu5(page, make_lab, make_user, add_member)

    field = page.get_by_role("combobox", name="Member")
    field.focus()
    page.keyboard.type("mil")
    options = page.locator("#grant-user-options [role=option]")
    expect(options).to_have_count(2)
    expect(page.locator("#grant-user-options")).not_to_contain_text("miles")
    expect(field).to_have_attribute("aria-expanded", "true")
    page.keyboard.press("ArrowDown")  # mila
    page.keyboard.press("ArrowDown")  # milo
    expect(options.nth(1)).to_have_attribute("aria-selected", "true")
    expect(field).to_have_attribute("aria-activedescendant", "grant-user-options-2")
    page.keyboard.press("Enter")  # choose
    expect(field).to_have_value("milo")
    expect(page.locator("#grant-user-options")).to_be_hidden()
    page.keyboard.press("Enter")  # submit

    expect(page.locator(".messages")).to_contain_text("Adding milo to tpu5")
    grant = Grant.objects.get(vm=vm)
    assert grant.user == milo and grant.state == "pending"
    assert reconciles == [vm.pk]
    expect(page.locator(f"#grant-{grant.pk} .badge")).to_have_text("Pending")


def test_a_list_that_arrives_after_the_choice_does_not_open_over_it(
    page, live_server, make_lab, make_user, add_member
):
    """The admin chose milo while the search for what they had typed was still on its
    way (a loaded server): its list arrives after the choice and stays closed, so the
    next Enter submits milo instead of landing on a list that opened again."""
    vm, _ = _on_the_access_page_of_tpu5(page, make_lab, make_user, add_member)

    field = page.get_by_role("combobox", name="Member")
    listbox = page.locator("#grant-user-options")
    field.focus()
    page.keyboard.type("mil")
    expect(listbox.locator("[role=option]")).to_have_count(2)
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")  # milo
    expect(field).to_have_value("milo")
    expect(listbox).to_be_hidden()
    # The list for "mil" arrives now, as a late answer to the search would.
    with page.expect_response(lambda r: "mil" in r.url and r.ok):
        page.evaluate(
            """([url, target]) => htmx.ajax("GET", url, {target: target, swap: "innerHTML",
                                                         values: {user: "mil"}})""",
            [f"/labs/{vm.lab.slug}/people/search/", "#grant-user-options"],
        )
    expect(listbox.locator("[role=option]")).to_have_count(2)  # it was swapped in
    expect(listbox).to_be_hidden()
    expect(field).to_have_attribute("aria-expanded", "false")
    # Typing again is a new search: its list opens.
    page.keyboard.press("Backspace")
    page.keyboard.press("Backspace")  # "mi"
    expect(listbox).to_be_visible()
    expect(field).to_have_attribute("aria-expanded", "true")

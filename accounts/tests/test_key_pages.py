"""The SSH keys page: every hostile input refused with its own message and nothing
stored, private keys forgotten everywhere, uploads, deleting, the unix username, and a
query count that does not grow with the number of keys."""

from __future__ import annotations

import html
import logging
from unittest import mock

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.views.debug import ExceptionReporter

from accounts import sshmessages
from accounts.keys import MAX_KEYS_PER_USER, add_key
from accounts.models import SSHKey, UnixAccount
from accounts.sshkeys import KeyRejected, parse_public_key
from accounts.tests import keydata
from accounts.tests.leaks import (
    PRIVATE_KEY_IDS,
    PRIVATE_KEY_KINDS,
    PUTTY_V3,
    assert_not_in,
    audit_text,
    fresh_key,
    logged_text,
)
from accounts.tests.test_usernames import REFUSED as REFUSED_USERNAMES
from tpus.models import AuditAction, AuditEvent

URL = "/account/keys/"


@pytest.fixture
def milo(client, make_user):
    user = make_user("milo@uni.example")
    client.force_login(user)
    return user


def post_key(client, text: str = "", label: str = "", **extra):
    return client.post(reverse("key_list"), {"key_text": text, "label": label, **extra})


def key_errors(response) -> list[str]:
    form = response.context["key_form"]
    return [e for errors in form.errors.values() for e in errors]


def parser_refusal(text: str) -> KeyRejected:
    with pytest.raises(KeyRejected) as info:
        parse_public_key(text)
    return info.value


def test_the_page_is_linked_from_every_page_and_shows_how_to_make_a_key(client, milo):
    response = client.get(reverse("dashboard"))
    assert f'href="{URL}"' in response.content.decode()
    page = client.get(URL).content.decode()
    assert 'ssh-keygen -t ed25519 -C "you@laptop"' in page
    assert "cat ~/.ssh/id_ed25519.pub" in page


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", keydata.HOSTILE, ids=[b.id for b in keydata.HOSTILE])
def test_each_hostile_key_is_refused_by_the_form_with_its_own_message(client, milo, bad):
    expected = parser_refusal(bad.text)
    assert expected.code == bad.code

    response = post_key(client, bad.text, "laptop")

    assert response.status_code == 200
    assert key_errors(response) == [expected.message]
    assert bad.fragment in expected.message
    assert html.escape(expected.message) in response.content.decode()
    assert not SSHKey.objects.exists()
    assert not AuditEvent.objects.exists()


def test_an_empty_form_asks_for_a_key(client, milo):
    response = post_key(client)
    assert key_errors(response) == [parser_refusal("").message]


@pytest.fixture(params=[*PRIVATE_KEY_KINDS, "putty"], ids=[*PRIVATE_KEY_IDS, "putty"])
def private_key(request, make_private_key) -> str:
    if request.param == "putty":
        return PUTTY_V3
    return make_private_key(*request.param)


def test_a_pasted_private_key_is_refused_forgotten_and_never_shown_or_logged(
    client, milo, private_key, caplog
):
    caplog.set_level(logging.DEBUG)
    with CaptureQueriesContext(connection) as queries:
        response = post_key(client, private_key, "oops")

    body = response.content.decode()
    assert response.status_code == 200
    [message] = key_errors(response)
    assert "treat it as compromised" in message and "ssh-keygen -t ed25519" in message
    # The textarea comes back empty: the key is not sent back to the browser.
    assert response.context["key_form"]["key_text"].value() == ""
    assert not SSHKey.objects.exists()
    assert not AuditEvent.objects.exists()
    assert_not_in(
        private_key, body, logged_text(caplog.records), audit_text(), str(queries.captured_queries)
    )


def test_an_uploaded_private_key_file_is_refused_the_same_way(client, milo, private_key, caplog):
    caplog.set_level(logging.DEBUG)
    upload = SimpleUploadedFile("id_ed25519", private_key.encode())

    response = post_key(client, key_file=upload)

    body = response.content.decode()
    assert any("treat it as compromised" in e for e in key_errors(response))
    assert not SSHKey.objects.exists()
    assert_not_in(private_key, body, logged_text(caplog.records), audit_text())


@pytest.mark.parametrize(
    "crashing", ["accounts.keys.parse_public_key", "accounts.views.keys.add_key"]
)
def test_an_unexpected_failure_while_holding_a_private_key_reports_none_of_it(
    client, milo, make_private_key, caplog, crashing
):
    """Even a bug (here: the parser or the use case crashing) must not put the key in
    the error report Django would email to the site admins, nor in the log."""
    caplog.set_level(logging.DEBUG)
    secret = make_private_key("ed25519", "RFC4716", "")
    client.raise_request_exception = False
    with mock.patch(crashing, side_effect=RuntimeError("bug")):
        response = post_key(client, secret, "oops")

    assert response.status_code == 500
    [record] = [r for r in caplog.records if r.name == "django.request"]
    report = ExceptionReporter(record.request, *record.exc_info)
    assert_not_in(
        secret,
        report.get_traceback_text(),
        report.get_traceback_html(),
        logged_text(caplog.records),
    )


def test_refusals_that_are_not_private_keys_keep_the_text_to_fix(client, milo):
    response = post_key(client, keydata.RSA_1024)
    assert response.context["key_form"]["key_text"].value() == keydata.RSA_1024


# --- accepted keys ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key_type", "bits"), keydata.ACCEPTED, ids=[a[1] for a in keydata.ACCEPTED]
)
def test_each_accepted_key_type_is_stored_as_parsed(client, milo, text, key_type, bits):
    response = post_key(client, text, "work laptop")

    assert response.status_code == 302
    key = SSHKey.objects.get(user=milo)
    parsed = parse_public_key(text)
    assert (key.key_type, key.bits, key.label) == (key_type, bits, "work laptop")
    assert key.blob_b64 == text.split()[1]  # FIDO keys keep their blob as-is
    assert key.fingerprint_sha256 == parsed.fingerprint_sha256
    assert key.comment == parsed.comment
    page = client.get(URL).content.decode()
    assert key.fingerprint_sha256 in page and "work laptop" in page


def test_the_listed_fingerprint_is_what_ssh_keygen_prints(client, milo, keygen_fingerprint):
    post_key(client, keydata.ED25519)
    key = SSHKey.objects.get()
    assert key.fingerprint_sha256 == keygen_fingerprint(keydata.ED25519)
    assert key.fingerprint_sha256 in client.get(URL).content.decode()


def test_an_rfc4716_key_is_converted_and_accepted(client, milo, keygen_rfc4716):
    response = post_key(client, keygen_rfc4716(keydata.RSA_2048))
    assert response.status_code == 302
    assert SSHKey.objects.get().blob_b64 == keydata.RSA_2048.split()[1]


@pytest.mark.parametrize(
    "data",
    [
        ("\ufeff" + keydata.ED25519 + "\r\n").encode("utf-16-le"),
        "\ufeff".encode("utf-16-be") + (keydata.ED25519 + "\n").encode("utf-16-be"),
        "\ufeff".encode() + (keydata.ED25519 + "\n").encode(),
        (keydata.ED25519 + "\n").encode(),
    ],
    ids=["utf-16-le-bom", "utf-16-be-bom", "utf-8-bom", "utf-8"],
)
def test_a_key_file_is_accepted_in_the_encodings_editors_write(client, milo, data):
    response = post_key(client, key_file=SimpleUploadedFile("id_ed25519.pub", data))
    assert response.status_code == 302
    assert (
        SSHKey.objects.get().fingerprint_sha256
        == parse_public_key(keydata.ED25519).fingerprint_sha256
    )


def test_a_binary_file_is_refused_as_not_a_key(client, milo):
    junk = bytes(range(256)) * 4
    response = post_key(client, key_file=SimpleUploadedFile("id_ed25519", junk))
    assert response.status_code == 200
    assert any("not a text file" in e for e in key_errors(response))
    assert not SSHKey.objects.exists()


def test_a_file_over_16_kib_is_refused(client, milo):
    big = (keydata.ED25519 + " " + "x" * (16 * 1024)).encode()
    response = post_key(client, key_file=SimpleUploadedFile("big.pub", big))
    assert any("16 KiB" in e for e in key_errors(response))
    assert not SSHKey.objects.exists()


def test_a_hostile_key_in_a_file_gets_the_same_message_as_pasted(client, milo):
    upload = SimpleUploadedFile("id.pub", f'command="/bin/sh" {keydata.ED25519}'.encode())
    response = post_key(client, key_file=upload)
    assert response.context["key_form"].errors["key_file"] == [
        parser_refusal(f'command="/bin/sh" {keydata.ED25519}').message
    ]


def test_pasting_and_uploading_at_once_is_refused(client, milo):
    upload = SimpleUploadedFile("id.pub", keydata.ED25519.encode())
    response = post_key(client, keydata.RSA_2048, key_file=upload)
    assert any("not both" in e for e in key_errors(response))
    assert not SSHKey.objects.exists()


# --- rules that need the database -------------------------------------------------------


def test_the_same_key_twice_on_one_account_is_refused_naming_the_first(client, milo):
    post_key(client, keydata.ED25519, "work laptop")
    response = post_key(client, keydata.ED25519, "again")
    assert key_errors(response) == [
        "You already added this key (“work laptop”). Each key needs adding only once."
    ]
    assert SSHKey.objects.count() == 1


def test_a_key_on_another_account_is_refused_without_saying_whose(client, milo, make_user):
    add_key(make_user("eve@other.example"), keydata.ED25519, "eve's")
    response = post_key(client, keydata.ED25519)
    [message] = key_errors(response)
    assert "already on another account" in message
    assert "eve@other.example" not in response.content.decode()
    assert SSHKey.objects.filter(user=milo).count() == 0


def test_the_portals_own_admin_key_is_refused(client, milo, settings):
    settings.PORTAL_ADMIN_SSH_PUBLIC_KEY = keydata.ECDSA_256
    response = post_key(client, keydata.ECDSA_256)
    assert key_errors(response) == [sshmessages.ADMIN_KEY]
    assert not SSHKey.objects.exists()


def test_an_account_holds_at_most_the_cap_of_keys(client, milo):
    for n in range(MAX_KEYS_PER_USER):
        add_key(milo, fresh_key(f"box{n}"))
    response = post_key(client, fresh_key())
    assert any(f"already have {MAX_KEYS_PER_USER} keys" in e for e in key_errors(response))
    assert SSHKey.objects.filter(user=milo).count() == MAX_KEYS_PER_USER


@pytest.mark.parametrize(
    ("label", "fragment"),
    [("x" * 101, "at most 100"), ("a\u202eb", "Control characters")],
    ids=["too-long", "bidi-override"],
)
def test_a_bad_label_is_refused(client, milo, label, fragment):
    response = post_key(client, keydata.ED25519, label)
    assert any(fragment in e for e in response.context["key_form"].errors["label"])
    assert not SSHKey.objects.exists()


# --- audit and propagation --------------------------------------------------------------


def test_adding_and_deleting_are_audited_with_the_fingerprint(client, milo):
    post_key(client, keydata.ED25519, "laptop")
    key = SSHKey.objects.get()
    client.post(reverse("key_delete", args=[key.pk]))

    deleted, added = AuditEvent.objects.all()
    assert (added.action, deleted.action) == (
        AuditAction.SSH_KEY_ADDED,
        AuditAction.SSH_KEY_DELETED,
    )
    for event in (added, deleted):
        assert event.actor == event.target_user == milo
        assert event.data["fingerprint"] == key.fingerprint_sha256
        assert event.ip_address == "127.0.0.1"


def test_each_add_and_delete_asks_the_vms_to_follow_exactly_once(client, milo):
    with mock.patch("tpus.services.access_changes.user_keys_changed") as changed:
        post_key(client, keydata.ED25519)
        assert changed.call_args_list == [mock.call(milo)]
        post_key(client, keydata.ED25519)  # refused: nothing changed
        post_key(client, keydata.RSA_1024)
        assert changed.call_count == 1
        key = SSHKey.objects.get()
        client.post(reverse("key_delete", args=[key.pk]))
        assert changed.call_args_list == [mock.call(milo), mock.call(milo)]


# --- deleting ---------------------------------------------------------------------------


def test_deleting_asks_for_confirmation_first(client, milo):
    key = add_key(milo, keydata.ED25519, "laptop")
    page = client.get(reverse("key_delete", args=[key.pk]))
    assert page.status_code == 200
    assert key.fingerprint_sha256 in page.content.decode()
    assert SSHKey.objects.exists()

    response = client.post(reverse("key_delete", args=[key.pk]))
    assert response.status_code == 302
    assert not SSHKey.objects.exists()


def test_someone_elses_key_cannot_be_seen_or_deleted(client, milo, make_user):
    key = add_key(make_user("eve@other.example"), keydata.ED25519)
    assert client.get(reverse("key_delete", args=[key.pk])).status_code == 404
    assert client.post(reverse("key_delete", args=[key.pk])).status_code == 404
    assert SSHKey.objects.filter(pk=key.pk).exists()


# --- the unix username ------------------------------------------------------------------


def choose(client, name: str):
    return client.post(reverse("unix_username"), {"username": name})


@pytest.mark.parametrize(
    ("name", "code", "fragment"),
    REFUSED_USERNAMES,
    ids=[r[0].encode("unicode_escape").decode() or "empty" for r in REFUSED_USERNAMES],
)
def test_each_unsuitable_username_is_refused_by_the_form(client, milo, name, code, fragment):
    response = choose(client, name)
    assert response.status_code == 200
    [message] = response.context["username_form"].errors["username"]
    assert fragment in message
    assert not UnixAccount.objects.exclude(username="").exists()


@pytest.mark.parametrize("name", ["milo", "m", "milo-smith", "ms2", "a" * 31, "rooty"])
def test_an_ordinary_username_is_taken_and_shown_with_its_uid(client, milo, name):
    response = choose(client, name)
    assert response.status_code == 302
    account = UnixAccount.objects.get(user=milo)
    assert account.username == name
    page = client.get(URL).content.decode()
    assert f"<code>{name}</code>" in page and f"UID {account.uid}" in page
    assert "same on every TPU VM" in page or "every TPU VM" in page


def test_a_username_taken_in_another_case_is_refused(client, milo, make_user):
    from accounts.unix import choose_username

    choose_username(make_user(), "milo")
    response = choose(client, "milo")
    assert response.context["username_form"].errors["username"] == [
        "“milo” is taken. Choose another username."
    ]


def test_the_username_is_suggested_from_the_first_keys_comment(client, milo):
    add_key(milo, keydata.ED25519.rsplit(" ", 1)[0] + " Milo.Smith@laptop")
    page = client.get(URL)
    assert page.context["suggestion"] == "milo-smith"
    assert 'value="milo-smith"' in page.content.decode()


def test_once_provisioned_the_username_is_shown_and_cannot_be_changed(client, milo):
    from accounts.unix import choose_username, mark_provisioned

    choose_username(milo, "milo")
    mark_provisioned(milo)
    page = client.get(URL).content.decode()
    assert "can no longer change" in page
    assert 'name="username"' not in page
    response = choose(client, "milo2")
    assert "can no longer change" in response.context["username_form"].errors["username"][0]
    assert UnixAccount.objects.get(user=milo).username == "milo"


# --- the dashboard card and query counts ------------------------------------------------


def test_the_dashboard_card_shows_how_to_make_a_key_until_there_is_one(client, milo):
    page = client.get(reverse("dashboard")).content.decode()
    assert "My SSH keys" in page and "No SSH keys yet" in page
    assert 'ssh-keygen -t ed25519 -C "you@laptop"' in page

    key = add_key(milo, keydata.ED25519, "laptop")
    page = client.get(reverse("dashboard")).content.decode()
    assert "No SSH keys yet" not in page and key.fingerprint_sha256 in page


@pytest.mark.parametrize("count", [1, 15])
def test_the_keys_page_makes_the_same_queries_however_many_keys(
    client, milo, count, django_assert_max_num_queries
):
    for n in range(count):
        add_key(milo, fresh_key(f"box{n}@lab"))
    with django_assert_max_num_queries(6):
        response = client.get(URL)
    assert len(response.context["ssh_keys"]) == count

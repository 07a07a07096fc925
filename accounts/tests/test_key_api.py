"""The keys and unix account API: the same refusals as the page, each with its code;
private keys forgotten; someone else's key a 404."""

from __future__ import annotations

import json
import logging
from unittest import mock

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.views.debug import ExceptionReporter

from accounts import sshmessages
from accounts.keys import add_key
from accounts.models import SSHKey, UnixAccount
from accounts.services import create_token
from accounts.sshkeys import KeyRejected, parse_public_key
from accounts.tests import keydata
from accounts.tests.leaks import (
    PRIVATE_KEY_IDS,
    PRIVATE_KEY_KINDS,
    PUTTY_V3,
    assert_not_in,
    audit_text,
    logged_text,
)
from accounts.tests.test_usernames import REFUSED as REFUSED_USERNAMES
from accounts.unix import choose_username, mark_provisioned
from tpus.models import AuditAction, AuditEvent


@pytest.fixture
def milo(make_user):
    return make_user("milo@uni.example")


@pytest.fixture
def api(client, milo):
    """Calls the API as milo, with a bearer token as scripts do."""
    _, raw = create_token(milo, "tests")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"}

    def call(method: str, path: str, body: dict | None = None):
        kwargs = {"content_type": "application/json", **headers}
        if body is not None:
            kwargs["data"] = json.dumps(body)
        return getattr(client, method)(f"/api/v1{path}", **kwargs)

    return call


def parser_refusal(text: str) -> KeyRejected:
    with pytest.raises(KeyRejected) as info:
        parse_public_key(text)
    return info.value


@pytest.mark.parametrize("bad", keydata.HOSTILE, ids=[b.id for b in keydata.HOSTILE])
def test_each_hostile_key_is_refused_with_its_code_and_message(api, bad):
    response = api("post", "/keys", {"key": bad.text, "label": "laptop"})

    assert response.status_code == 400
    assert response.json() == {"code": bad.code, "detail": parser_refusal(bad.text).message}
    assert bad.fragment in response.json()["detail"]
    assert not SSHKey.objects.exists()
    assert not AuditEvent.objects.exclude(action=AuditAction.TOKEN_CREATED).exists()


@pytest.fixture(params=[*PRIVATE_KEY_KINDS, "putty"], ids=[*PRIVATE_KEY_IDS, "putty"])
def private_key(request, make_private_key) -> str:
    if request.param == "putty":
        return PUTTY_V3
    return make_private_key(*request.param)


def test_a_private_key_is_refused_and_never_stored_echoed_or_logged(api, private_key, caplog):
    caplog.set_level(logging.DEBUG)
    with CaptureQueriesContext(connection) as queries:
        response = api("post", "/keys", {"key": private_key, "label": "oops"})

    assert response.status_code == 400
    assert response.json()["code"] == "private_key"
    assert "treat it as compromised" in response.json()["detail"]
    assert not SSHKey.objects.exists()
    assert_not_in(
        private_key,
        response.content.decode(),
        logged_text(caplog.records),
        audit_text(),
        str(queries.captured_queries),
    )


def test_a_private_key_sent_as_the_wrong_type_is_not_echoed(api, make_private_key, caplog):
    caplog.set_level(logging.DEBUG)
    secret = make_private_key("ed25519", "RFC4716", "")
    response = api("post", "/keys", {"key": [secret], "label": "oops"})
    assert response.status_code == 422
    assert_not_in(secret, response.content.decode(), logged_text(caplog.records))


def test_an_unexpected_failure_while_holding_a_private_key_reports_none_of_it(
    api, make_private_key, caplog, client
):
    caplog.set_level(logging.DEBUG)
    secret = make_private_key("ed25519", "RFC4716", "")
    client.raise_request_exception = False
    with mock.patch("accounts.keys.parse_public_key", side_effect=RuntimeError("bug")):
        response = api("post", "/keys", {"key": secret, "label": "oops"})

    assert response.status_code == 500
    [record] = [r for r in caplog.records if r.name == "django.request"]
    report = ExceptionReporter(record.request, *record.exc_info)
    assert_not_in(
        secret,
        report.get_traceback_text(),
        report.get_traceback_html(),
        logged_text(caplog.records),
        response.content.decode(),
    )


@pytest.mark.parametrize(
    ("text", "key_type", "bits"), keydata.ACCEPTED, ids=[a[1] for a in keydata.ACCEPTED]
)
def test_each_accepted_key_is_added_listed_and_deleted(api, milo, text, key_type, bits):
    response = api("post", "/keys", {"key": text, "label": "  yubikey  "})

    assert response.status_code == 201
    body = response.json()
    parsed = parse_public_key(text)
    assert body["key_type"] == key_type and body["bits"] == bits
    assert body["fingerprint_sha256"] == parsed.fingerprint_sha256
    assert body["label"] == "yubikey" and body["comment"] == parsed.comment
    assert [k["id"] for k in api("get", "/keys").json()["items"]] == [body["id"]]

    assert api("delete", f"/keys/{body['id']}").status_code == 204
    assert api("get", "/keys").json()["items"] == []
    assert api("delete", f"/keys/{body['id']}").status_code == 404


def test_the_same_key_twice_is_a_duplicate(api):
    api("post", "/keys", {"key": keydata.ED25519, "label": "laptop"})
    response = api("post", "/keys", {"key": keydata.ED25519})
    assert response.status_code == 400
    assert response.json()["code"] == "duplicate"
    assert "“laptop”" in response.json()["detail"]


def test_a_key_on_another_account_is_in_use_without_saying_whose(api, make_user):
    add_key(make_user("eve@other.example"), keydata.ED25519)
    response = api("post", "/keys", {"key": keydata.ED25519})
    assert response.status_code == 400
    assert response.json() == {"code": "in_use", "detail": sshmessages.IN_USE}


def test_the_admin_key_from_the_pub_file_next_to_the_private_key_is_refused(
    api, settings, tmp_path
):
    private = tmp_path / "portal_admin"
    private.write_text("not read: only the .pub next to it is\n")
    (tmp_path / "portal_admin.pub").write_text(keydata.RSA_2048 + "\n")
    settings.PORTAL_ADMIN_SSH_KEY_FILE = str(private)

    response = api("post", "/keys", {"key": keydata.RSA_2048})

    assert response.json() == {"code": "admin_key", "detail": sshmessages.ADMIN_KEY}
    assert api("post", "/keys", {"key": keydata.ED25519}).status_code == 201


def test_a_bad_label_is_a_validation_error(api):
    response = api("post", "/keys", {"key": keydata.ED25519, "label": "a\nb"})
    assert response.status_code == 422
    assert not SSHKey.objects.exists()


def test_someone_elses_key_is_a_404_and_stays(api, make_user):
    key = add_key(make_user("eve@other.example"), keydata.ED25519)
    assert api("delete", f"/keys/{key.pk}").status_code == 404
    assert SSHKey.objects.filter(pk=key.pk).exists()


def test_each_add_and_delete_asks_the_vms_to_follow_exactly_once(api, milo):
    with mock.patch("tpus.services.access_changes.user_keys_changed") as changed:
        key_id = api("post", "/keys", {"key": keydata.ED25519}).json()["id"]
        api("post", "/keys", {"key": keydata.ED25519})
        assert changed.call_args_list == [mock.call(milo)]
        api("delete", f"/keys/{key_id}")
        api("delete", f"/keys/{key_id}")
        assert changed.call_args_list == [mock.call(milo), mock.call(milo)]


# --- the unix account -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "code", "fragment"),
    REFUSED_USERNAMES,
    ids=[r[0].encode("unicode_escape").decode() or "empty" for r in REFUSED_USERNAMES],
)
def test_each_unsuitable_username_is_refused_with_its_code(api, name, code, fragment):
    response = api("put", "/unix-account", {"username": name})
    assert response.status_code == 400
    assert response.json()["code"] == code
    assert fragment in response.json()["detail"]
    assert not UnixAccount.objects.exclude(username="").exists()


def test_a_username_is_chosen_and_gets_a_uid_in_range(api, settings):
    before = api("get", "/unix-account").json()
    assert before == {
        "username": None,
        "uid": None,
        "gid": None,
        "locked": False,
        "suggestion": "milo",
    }

    response = api("put", "/unix-account", {"username": "milo"})

    assert response.status_code == 200
    body = response.json()
    assert body["username"] == "milo" and body["uid"] == body["gid"]
    assert settings.PORTAL_UID_MIN <= body["uid"] <= settings.PORTAL_UID_MAX
    assert body["locked"] is False and body["suggestion"] is None
    assert api("get", "/unix-account").json() == body


def test_the_suggestion_comes_from_the_first_keys_comment(api):
    api("post", "/keys", {"key": keydata.ED25519.rsplit(" ", 1)[0] + " milo@laptop"})
    assert api("get", "/unix-account").json()["suggestion"] == "milo"


def test_a_taken_suggestion_gets_a_number(api, make_user):
    choose_username(make_user(), "milo")
    assert api("get", "/unix-account").json()["suggestion"] == "milo2"


def test_a_name_someone_has_is_taken_in_any_case(api, make_user):
    choose_username(make_user(), "milo")
    response = api("put", "/unix-account", {"username": "milo"})
    assert response.status_code == 400
    assert response.json()["code"] == "taken"


def test_the_username_is_locked_once_the_account_exists_on_a_host(api, milo):
    assert api("put", "/unix-account", {"username": "milo"}).status_code == 200
    assert api("put", "/unix-account", {"username": "milo-s"}).status_code == 200
    mark_provisioned(milo)

    response = api("put", "/unix-account", {"username": "milo"})

    assert response.status_code == 400 and response.json()["code"] == "locked"
    assert api("get", "/unix-account").json()["locked"] is True
    # Choosing the current name again is not a change, so it is fine.
    assert api("put", "/unix-account", {"username": "milo-s"}).status_code == 200
    chosen = AuditEvent.objects.filter(action=AuditAction.UNIX_USERNAME_CHOSEN)
    assert [e.data["username"] for e in chosen.order_by("id")] == ["milo", "milo-s"]

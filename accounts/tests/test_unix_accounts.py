"""Unix accounts and keys in the database: UIDs allocated from the configured range,
stable and never given to anyone else; the constraints that hold even when code
forgets a check; the admin's key; concurrency on PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, connections, transaction
from django.urls import reverse

from accounts.keys import add_key, admin_key_fingerprints
from accounts.models import SSHKey, UidAllocation, UnixAccount
from accounts.sshkeys import KeyRejected, parse_public_key
from accounts.tests import keydata
from accounts.tests.leaks import fresh_key
from accounts.unix import (
    UnixAccountError,
    choose_username,
    ensure_unix_account,
    mark_names_provisioned,
    mark_provisioned,
    suggested_username,
)
from tpus.models import AuditAction, AuditEvent
from tpus.services import access_changes

# --- UIDs -------------------------------------------------------------------------------


def test_the_first_account_gets_the_bottom_of_the_range_and_gid_equals_uid(make_user, settings):
    account = ensure_unix_account(make_user())
    assert account.uid == settings.PORTAL_UID_MIN == 70000
    assert account.gid == account.uid
    assert account.username == "" and not account.locked


def test_a_uid_is_stable_for_its_person(make_user):
    user = make_user()
    first = ensure_unix_account(user)
    choose_username(user, "milo")
    choose_username(user, "milo-s")
    assert ensure_unix_account(user).uid == first.uid
    assert UidAllocation.objects.count() == 1


def test_uids_follow_each_other_within_the_configured_range(make_user, settings):
    settings.PORTAL_UID_MIN, settings.PORTAL_UID_MAX = 30000, 30002
    uids = [ensure_unix_account(make_user()).uid for _ in range(3)]
    assert uids == [30000, 30001, 30002]

    with pytest.raises(UnixAccountError) as info:
        ensure_unix_account(make_user())
    assert info.value.code == "no_uids_left"
    assert "site admin" in info.value.message


def test_a_deleted_persons_uid_is_never_given_to_anyone_else(make_user):
    gone = make_user()
    uid = ensure_unix_account(gone).uid
    gone.delete()
    assert UidAllocation.objects.get(uid=uid).user is None

    assert ensure_unix_account(make_user()).uid == uid + 1


def test_a_removed_unix_account_made_again_keeps_its_uid(make_user):
    user, other = make_user(), make_user()
    uid = ensure_unix_account(user).uid
    ensure_unix_account(other)
    UnixAccount.objects.filter(user=user).delete()

    assert ensure_unix_account(user).uid == uid
    assert ensure_unix_account(make_user()).uid == uid + 2


def test_moving_the_range_never_reuses_a_uid(make_user, settings):
    first = ensure_unix_account(make_user()).uid
    settings.PORTAL_UID_MIN, settings.PORTAL_UID_MAX = 80000, 80010
    assert ensure_unix_account(make_user()).uid == 80000
    settings.PORTAL_UID_MIN, settings.PORTAL_UID_MAX = 70000, 99999
    assert ensure_unix_account(make_user()).uid == 80001
    assert first == 70000


def test_refused_usernames_allocate_nothing(make_user):
    with pytest.raises(UnixAccountError):
        choose_username(make_user(), "root")
    assert not UnixAccount.objects.exists() and not UidAllocation.objects.exists()


# --- usernames --------------------------------------------------------------------------


def test_choosing_a_username_makes_the_account_and_is_audited(make_user):
    user = make_user()
    account = choose_username(user, "milo")
    assert (account.username, account.uid) == ("milo", 70000)
    event = AuditEvent.objects.get(action=AuditAction.UNIX_USERNAME_CHOSEN)
    assert event.actor == event.target_user == user
    assert event.data == {"username": "milo", "previous": "", "uid": 70000}


def test_choosing_the_same_username_again_changes_nothing(make_user):
    user = make_user()
    choose_username(user, "milo")
    choose_username(user, "milo")
    assert AuditEvent.objects.filter(action=AuditAction.UNIX_USERNAME_CHOSEN).count() == 1


def test_the_username_is_fixed_once_provisioned(make_user):
    user = make_user()
    choose_username(user, "milo")
    mark_provisioned(user)
    first = UnixAccount.objects.get(user=user).provisioned_at
    mark_provisioned(user)
    assert UnixAccount.objects.get(user=user).provisioned_at == first

    with pytest.raises(UnixAccountError) as info:
        choose_username(user, "milo2")
    assert info.value.code == "locked"
    assert UnixAccount.objects.get(user=user).username == "milo"


def test_a_name_that_was_on_the_hosts_is_never_given_to_anyone_else(make_user):
    gone, left = make_user(), make_user()
    for person, name in ((gone, "milo"), (left, "ana")):
        ensure_unix_account(person)
        UnixAccount.objects.filter(user=person).update(username=name)  # (no audit row)
        mark_provisioned(person)
    gone.delete()  # their locked account and files on the hosts still say "milo"
    UnixAccount.objects.filter(user=left).delete()  # an account row removed by hand
    assert set(UidAllocation.objects.values_list("username", flat=True)) == {"milo", "ana"}

    newcomer = make_user(email="milo@example.org")
    for name in ("milo", "ana"):
        with pytest.raises(UnixAccountError) as info:
            choose_username(newcomer, name)
        assert info.value.code == "taken"
    assert suggested_username(newcomer) == "milo2"
    assert not UnixAccount.objects.filter(user=newcomer).exclude(username="").exists()
    # The person whose account row went keeps their name with their UID.
    assert choose_username(left, "ana").username == "ana"


def test_marking_names_says_when_one_changed_since_it_was_read(make_user):
    milo, ana = make_user(), make_user()
    for person, name in ((milo, "milo"), (ana, "ana")):
        ensure_unix_account(person)
        UnixAccount.objects.filter(user=person).update(username=name)
    read = ["milo", "ana"]
    choose_username(ana, "anna")  # chosen after the state was read, before marking

    assert mark_names_provisioned(read) is False
    assert UnixAccount.objects.get(user=milo).provisioned_at is not None
    assert UnixAccount.objects.get(user=ana).provisioned_at is None
    assert mark_names_provisioned(["milo", "anna"]) is True
    with pytest.raises(UnixAccountError):
        choose_username(ana, "ana")


def test_a_name_chosen_but_never_on_a_host_is_free_again(make_user):
    gone = make_user()
    ensure_unix_account(gone)
    UnixAccount.objects.filter(user=gone).update(username="milo")
    gone.delete()
    assert choose_username(make_user(), "milo").username == "milo"


def test_the_database_refuses_the_same_username_in_another_case(make_user):
    ensure_unix_account(make_user())
    UnixAccount.objects.update(username="milo")
    other = ensure_unix_account(make_user())
    with pytest.raises(IntegrityError), transaction.atomic():
        UnixAccount.objects.filter(pk=other.pk).update(username="Milo")


def test_many_accounts_may_have_no_username_yet(make_user):
    for _ in range(3):
        ensure_unix_account(make_user())
    assert UnixAccount.objects.filter(username="").count() == 3


def test_the_database_refuses_one_uid_for_two_accounts(make_user):
    first = ensure_unix_account(make_user())
    with pytest.raises(IntegrityError), transaction.atomic():
        UnixAccount.objects.create(user=make_user(), uid=first.uid)


# --- keys in the database ---------------------------------------------------------------


def test_the_database_refuses_one_key_on_two_accounts(make_user):
    key = add_key(make_user(), keydata.ED25519)
    with pytest.raises(IntegrityError), transaction.atomic():
        SSHKey.objects.create(
            user=make_user(),
            key_type=key.key_type,
            blob_b64=key.blob_b64,
            bits=key.bits,
            fingerprint_sha256=key.fingerprint_sha256,
        )


@pytest.mark.parametrize(
    ("text", "key_type", "bits"), keydata.ACCEPTED, ids=[a[1] for a in keydata.ACCEPTED]
)
def test_the_authorized_keys_line_is_rebuilt_from_the_stored_key(make_user, text, key_type, bits):
    key = add_key(make_user(), text + " extra words")
    line = key.authorized_keys_line(f"tpu-portal:{key.pk}")
    assert line == f"{key_type} {text.split()[1]} tpu-portal:{key.pk}"
    assert parse_public_key(line).fingerprint_sha256 == key.fingerprint_sha256


def test_with_no_grants_a_key_change_asks_for_no_reconcile(make_user):
    # Nothing to reconcile yet: the call finds no VMs and returns.
    assert list(access_changes.vms_with_access(make_user())) == []
    assert access_changes.user_keys_changed(make_user()) is None


# --- the portal's own key ---------------------------------------------------------------


def test_without_an_admin_key_configured_nothing_is_refused_as_one(settings, tmp_path):
    settings.PORTAL_ADMIN_SSH_PUBLIC_KEY = ""
    settings.PORTAL_ADMIN_SSH_KEY_FILE = str(tmp_path / "no-pub-next-to-me")
    assert admin_key_fingerprints() == []


def test_the_admin_key_may_be_given_as_text(settings, make_user):
    settings.PORTAL_ADMIN_SSH_PUBLIC_KEY = keydata.ED25519
    assert admin_key_fingerprints() == [parse_public_key(keydata.ED25519).fingerprint_sha256]
    with pytest.raises(KeyRejected) as info:
        add_key(make_user(), keydata.ED25519)
    assert info.value.code == "admin_key"


def test_an_unusable_admin_public_key_fails_loudly(settings):
    settings.PORTAL_ADMIN_SSH_PUBLIC_KEY = "ssh-dss AAAA"
    with pytest.raises(ImproperlyConfigured, match="PORTAL_ADMIN_SSH_PUBLIC_KEY"):
        admin_key_fingerprints()


# --- the site admin ---------------------------------------------------------------------


def test_site_admins_see_keys_and_accounts_but_cannot_type_them_in(client, cast):
    key = add_key(cast.member, keydata.ED25519)
    account = choose_username(cast.member, "milo")
    client.force_login(cast.site_admin)
    for name in ("sshkey", "unixaccount", "uidallocation"):
        assert client.get(reverse(f"admin:accounts_{name}_changelist")).status_code == 200
        assert client.get(reverse(f"admin:accounts_{name}_add")).status_code == 403
    page = client.get(reverse("admin:accounts_sshkey_change", args=[key.pk])).content.decode()
    assert 'name="fingerprint_sha256"' not in page and key.fingerprint_sha256 in page
    page = client.get(reverse("admin:accounts_unixaccount_change", args=[account.pk]))
    assert 'name="uid"' not in page.content.decode()


def test_a_key_deleted_by_a_site_admin_is_audited_as_theirs(client, cast):
    key = add_key(cast.member, keydata.ED25519)
    client.force_login(cast.site_admin)
    client.post(reverse("admin:accounts_sshkey_delete", args=[key.pk]), {"post": "yes"})
    assert not SSHKey.objects.exists()
    event = AuditEvent.objects.get(action=AuditAction.SSH_KEY_DELETED)
    assert (event.actor, event.target_user) == (cast.site_admin, cast.member)


# --- concurrency (PostgreSQL: SQLite serialises every write, so nothing races) ----------


def _needs_postgres():
    if connection.vendor != "postgresql":
        pytest.skip("concurrent transactions need PostgreSQL (PORTAL_TEST_BACKEND=services)")


def _run_together(work, items) -> tuple[list, list]:
    """Run ``work(item)`` in one thread per item, all starting at once."""
    barrier = threading.Barrier(len(items))
    results, errors = [], []

    def run(item):
        try:
            barrier.wait()
            results.append(work(item))
        except Exception as exc:  # collected and asserted on by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results, errors


@pytest.mark.django_db(transaction=True)
def test_concurrent_allocations_never_give_two_people_one_uid(make_user, settings):
    _needs_postgres()
    users = [make_user() for _ in range(12)]

    # Twelve at once collide on the same next UID again and again; each loser retries.
    uids, errors = _run_together(lambda user: ensure_unix_account(user).uid, users)

    assert not errors
    assert sorted(uids) == list(range(settings.PORTAL_UID_MIN, settings.PORTAL_UID_MIN + 12))
    assert UidAllocation.objects.count() == 12


@pytest.mark.django_db(transaction=True)
def test_concurrent_first_requests_of_one_person_make_one_account(make_user):
    _needs_postgres()
    user = make_user()
    results, errors = _run_together(lambda _: ensure_unix_account(user).uid, range(4))
    assert not errors and len(set(results)) == 1
    assert UidAllocation.objects.count() == UnixAccount.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_one_key_added_by_two_people_at_once_lands_on_one_account(make_user):
    _needs_postgres()
    line = fresh_key()
    results, errors = _run_together(
        lambda user: add_key(user, line).pk, [make_user() for _ in range(3)]
    )
    assert len(results) == 1 and SSHKey.objects.count() == 1
    assert [e.code for e in errors] == ["in_use", "in_use"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_of_one_username_leave_it_to_one_person(make_user):
    _needs_postgres()
    results, errors = _run_together(
        lambda user: choose_username(user, "milo").pk, [make_user() for _ in range(3)]
    )
    assert len(results) == 1
    assert [e.code for e in errors] == ["taken", "taken"]
    assert UnixAccount.objects.filter(username="milo").count() == 1

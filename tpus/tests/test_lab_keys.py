"""Each lab's own SSH key pair: made by the portal, kept encrypted, never shown, and the
only key the portal logs in to that lab's workers with."""

from __future__ import annotations

import logging

import pytest
from cryptography.fernet import Fernet
from django.apps import apps
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.urls import reverse

from accounts.keys import add_key
from accounts.sshkeys import KeyRejected
from portal import secrets
from tpus.models import Lab, LabKey
from tpus.services import labkeys


def _stored_ciphertext(key: LabKey) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT private_key_encrypted FROM tpus_labkey WHERE id = %s", [key.pk])
        return cursor.fetchone()[0]


def test_a_lab_gets_one_ed25519_key_pair_made_on_first_use(make_lab):
    lab = make_lab()
    assert not LabKey.objects.filter(lab=lab).exists()
    key = labkeys.lab_key(lab)
    assert key.public_key.startswith("ssh-ed25519 ")
    assert key.public_line == f"{key.public_key} tpu-portal@{lab.slug}"
    assert labkeys.lab_key(lab).pk == key.pk
    assert key.fingerprint == labkeys.fingerprint(key.public_key)


def test_two_labs_never_share_a_key(make_lab):
    first, second = labkeys.lab_key(make_lab()), labkeys.lab_key(make_lab())
    assert first.public_key != second.public_key


def test_the_private_half_is_stored_encrypted(make_lab):
    key = labkeys.lab_key(make_lab())
    stored = _stored_ciphertext(key)
    assert "PRIVATE KEY" not in stored and "openssh-key" not in stored
    assert b"OPENSSH PRIVATE KEY" in secrets.decrypt(stored)


def test_the_login_is_the_labs_account_with_the_labs_key(make_lab, settings):
    settings.PORTAL_LAB_SSH_USER = "tpu-portal"
    lab = make_lab()
    login = labkeys.login_for(lab)
    assert login.user == "tpu-portal"
    assert f"{login.key.get_name()} {login.key.get_base64()}" == labkeys.lab_key(lab).public_key


def test_the_private_key_never_appears_in_reprs_or_logs(make_lab, caplog):
    caplog.set_level(logging.DEBUG)
    lab = make_lab()
    key = labkeys.lab_key(lab)
    login = labkeys.login_for(lab)
    private = secrets.decrypt(_stored_ciphertext(key)).decode()
    body = private.splitlines()[1]
    for text in (repr(key), str(key), repr(login), caplog.text):
        assert body not in text
        assert key.private_key_encrypted not in text


def test_the_django_admin_shows_the_public_half_only(client, make_lab, make_user):
    lab = make_lab()
    key = labkeys.lab_key(lab)
    client.force_login(make_user(is_staff=True, is_superuser=True))
    page = client.get(reverse("admin:tpus_labkey_change", args=[key.pk])).content.decode()
    assert key.public_key in page
    assert key.private_key_encrypted not in page
    assert "PRIVATE" not in page


def test_a_rotated_secrets_key_still_opens_old_keys_and_rotation_rewrites_them(make_lab, settings):
    lab = make_lab()
    before = labkeys.login_for(lab).key.get_base64()
    old = settings.PORTAL_SECRETS_KEY
    settings.PORTAL_SECRETS_KEY = Fernet.generate_key().decode()
    settings.PORTAL_SECRETS_OLD_KEYS = [old]
    labkeys._private_key.cache_clear()
    assert labkeys.login_for(lab).key.get_base64() == before
    call_command("rotate_secrets")
    settings.PORTAL_SECRETS_OLD_KEYS = []
    labkeys._private_key.cache_clear()
    assert labkeys.login_for(LabKey.objects.get(lab=lab).lab).key.get_base64() == before


def test_a_lost_secrets_key_is_a_clear_error_not_a_new_key(make_lab, settings):
    lab = make_lab()
    labkeys.lab_key(lab)
    settings.PORTAL_SECRETS_KEY = Fernet.generate_key().decode()
    labkeys._private_key.cache_clear()
    with pytest.raises(secrets.SecretUnreadable, match="PORTAL_SECRETS_OLD_KEYS"):
        labkeys.login_for(lab)


def test_a_labs_public_key_cannot_be_uploaded_as_a_persons_key(make_lab, make_user):
    key = labkeys.lab_key(make_lab())
    with pytest.raises(KeyRejected):
        add_key(make_user(), key.public_line)


def test_only_site_admins_let_a_lab_use_the_site_key_and_only_one_lab(make_lab, make_user):
    first, second = make_lab(), make_lab()
    with pytest.raises(labkeys.LabKeyError, match="site admins"):
        labkeys.set_uses_site_key(make_user(), first, True)
    site_admin = make_user(is_staff=True, is_superuser=True)
    labkeys.set_uses_site_key(site_admin, first, True)
    with pytest.raises(labkeys.LabKeyError, match="at most one"):
        labkeys.set_uses_site_key(site_admin, second, True)
    assert list(Lab.objects.filter(uses_site_key=True)) == [first]
    with pytest.raises(IntegrityError), transaction.atomic():
        Lab.objects.filter(pk=second.pk).update(uses_site_key=True)


def test_the_lab_that_uses_the_site_key_logs_in_with_it(make_lab, make_user, settings, tmp_path):
    from tpus.remote import site_login

    private = tmp_path / "admin_key"
    from testfleet.hostfs import write_keypair

    write_keypair(private, "ed25519", "portal-admin")
    settings.PORTAL_ADMIN_SSH_KEY_FILE = str(private)
    settings.PORTAL_ADMIN_SSH_USER = "admin"
    lab = make_lab()
    labkeys.set_uses_site_key(make_user(is_staff=True, is_superuser=True), lab, True)
    login = labkeys.login_for(lab)
    assert login.user == "admin"
    assert login.key.get_base64() == site_login().key.get_base64()


def _migration():
    from importlib import import_module

    return import_module("tpus.migrations.0005_lab_keys")


def test_upgrading_a_single_lab_portal_keeps_it_on_the_site_key(make_lab, settings):
    settings.PORTAL_ADMIN_SSH_KEY_FILE = "/etc/portal/admin_key"
    lab = make_lab()
    _migration().keep_single_lab_on_site_key(apps, None)
    lab.refresh_from_db()
    assert lab.uses_site_key


def test_upgrading_a_portal_with_several_labs_marks_none(make_lab, settings):
    settings.PORTAL_ADMIN_SSH_KEY_FILE = "/etc/portal/admin_key"
    make_lab(), make_lab()
    _migration().keep_single_lab_on_site_key(apps, None)
    assert not Lab.objects.filter(uses_site_key=True).exists()

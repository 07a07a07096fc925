"""/healthz tells a load balancer and a monitor which part of the portal is down."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from django.core.checks import run_checks

from portal import heartbeat
from tpus.services import labkeys


def test_everything_up_is_ok(client, db):
    heartbeat.beat()
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert {name: check["ok"] for name, check in body["checks"].items()} == {
        "database": True,
        "broker": True,
        "lab_keys": True,
        "static_files": True,
        "beat_and_workers": True,
    }
    assert response["Cache-Control"].startswith("max-age=0")


def test_no_heartbeat_is_degraded_but_still_serves_unless_strict(client, db):
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "degraded"
    assert "no heartbeat" in body["checks"]["beat_and_workers"]["error"]
    assert client.get("/healthz?strict=1").status_code == 503


def test_a_broker_that_does_not_answer_fails_the_check(client, db, settings):
    heartbeat.beat()
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"  # nothing listens there
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "failing"
    assert body["checks"]["broker"]["ok"] is False and body["checks"]["database"]["ok"]


def test_it_shows_no_secret(client, db, settings):
    settings.CELERY_BROKER_URL = "redis://:hunter2@127.0.0.1:9/0"
    body = client.get("/healthz").content.decode()
    assert "hunter2" not in body


def test_lab_keys_the_configured_secrets_key_cannot_open_fail_the_check_without_showing_a_secret(
    client, make_lab, settings
):
    heartbeat.beat()
    labkeys.lab_key(make_lab("Vision", slug="vision"))
    labkeys.lab_key(make_lab("Speech", slug="speech"))
    old = settings.PORTAL_SECRETS_KEY
    settings.PORTAL_SECRETS_KEY = Fernet.generate_key().decode()  # changed, old one not kept
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "failing" and body["checks"]["database"]["ok"]
    error = body["checks"]["lab_keys"]["error"]
    assert "the SSH private key of 2 lab(s) cannot be decrypted with PORTAL_SECRETS_KEY" in error
    text = response.content.decode()
    assert old not in text and settings.PORTAL_SECRETS_KEY not in text
    assert "vision" not in text and "speech" not in text.lower()
    assert "tpus.E004" in {m.id for m in run_checks(include_deployment_checks=True)}

    settings.PORTAL_SECRETS_OLD_KEYS = [old]  # the way a rotation lists it
    assert client.get("/healthz").json()["checks"]["lab_keys"]["ok"] is True
    assert "tpus.E004" not in {m.id for m in run_checks(include_deployment_checks=True)}


@pytest.fixture
def production_static(settings, tmp_path):
    """Static files served as production does (hashed names from a manifest), from a
    STATIC_ROOT where collectstatic has not run."""
    settings.STATIC_ROOT = tmp_path / "static"
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    }
    return settings.STATIC_ROOT


def test_a_missing_static_manifest_fails_the_check_and_check_deploy_says_so(
    client, db, production_static
):
    heartbeat.beat()
    response = client.get("/healthz")
    assert response.status_code == 503
    error = response.json()["checks"]["static_files"]["error"]
    assert "static files manifest is missing" in error and "collectstatic" in error
    assert str(production_static) not in response.content.decode()
    assert "portal.E001" in {m.id for m in run_checks(include_deployment_checks=True)}

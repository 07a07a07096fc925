"""/healthz tells a load balancer and a monitor which part of the portal is down."""

from __future__ import annotations

from portal import heartbeat


def test_everything_up_is_ok(client, db):
    heartbeat.beat()
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert {name: check["ok"] for name, check in body["checks"].items()} == {
        "database": True,
        "broker": True,
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

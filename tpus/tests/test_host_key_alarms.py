"""An admin ends a worker's host key alarm from the page or the API; the reconcile
that follows still connects only with the pinned keys."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from accounts.tests.keydata import ED25519
from tpus.models import AuditEvent, TpuVm, Worker

PINNED = " ".join(ED25519.split()[:2])
PRESENTED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGmq8Ajnn7qAVXoI9/9HUd9WQnXOJk4aOuq2SPeVvJGh"


@pytest.fixture
def alarmed(cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="imported")
    return Worker.objects.create(
        vm=vm, index=0, external_ip="198.18.0.5", host_keys=[PINNED],
        host_key_mismatch_at=timezone.now(), presented_host_key=PRESENTED,
    )  # fmt: skip


def test_the_api_shows_the_alarm_and_the_last_error_of_each_worker(client, cast, alarmed):
    token = create_token(cast.admin, "t")[1]
    body = client.get(
        f"/api/v1/labs/{cast.lab.slug}/vms/{alarmed.vm.pk}", HTTP_AUTHORIZATION=f"Bearer {token}"
    ).json()
    [worker] = body["workers"]
    assert worker["host_key_alarm_since"] and worker["presented_host_key"] == PRESENTED
    assert worker["last_error"] == "" and worker["applied_version"] is None


def test_an_admin_resumes_a_worker_through_the_api(
    client, cast, alarmed, django_capture_on_commit_callbacks
):
    token = create_token(cast.admin, "t")[1]
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{alarmed.vm.pk}/workers/0/resume"
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post(url, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response.json()["host_key_alarm_since"] is None
    assert len(callbacks) == 1  # a reconcile, after commit
    assert AuditEvent.objects.filter(action="vm.host_key_alarm_cleared", actor=cast.admin).exists()
    again = client.post(url, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert again.status_code == 409 and "no host key alarm" in again.json()["detail"]


def test_an_admin_resumes_a_worker_from_its_page(client, cast, alarmed):
    client.force_login(cast.admin)
    url = reverse("worker_keys", args=[cast.lab.slug, alarmed.vm.pk, 0])
    response = client.post(url, {"action": "resume"})
    assert response.status_code == 302
    alarmed.refresh_from_db()
    assert alarmed.host_key_mismatch_at is None and alarmed.presented_host_key == ""


def test_a_member_cannot_resume_a_worker(client, cast, alarmed):
    token = create_token(cast.member, "t")[1]
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{alarmed.vm.pk}/workers/0/resume"
    assert client.post(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 403
    alarmed.refresh_from_db()
    assert alarmed.host_key_mismatch_at is not None


def test_the_api_tells_an_alarm_that_stops_a_worker_from_one_about_published_keys(
    client, cast, alarmed
):
    token = create_token(cast.admin, "t")[1]
    vm = alarmed.vm.pk
    progress = f"/api/v1/labs/{cast.lab.slug}/vms/{vm}/progress"
    keys = f"/api/v1/labs/{cast.lab.slug}/vms/{vm}/workers/0/host-keys"

    def state() -> str:
        auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        [worker] = client.get(progress, **auth).json()["workers"]
        assert client.get(keys, **auth).json()["state"] == worker["host_keys"]
        return worker["host_keys"]

    assert state() == "alarm"
    Worker.objects.filter(pk=alarmed.pk).update(host_key_alarm_published=True)
    assert state() == "published_alarm"

"""A lab's limits for each job on each worker (tasks, memory, log size): set on the
settings page and through the API, refused with the field's reason when out of range,
and sent to every worker with the job's start (with the site's folder retention)."""

from __future__ import annotations

import pytest

from accounts.services import create_token
from tpus.models import Lab
from tpus.remote import jobs as wire
from tpus.services.job_engine import job_limits


@pytest.fixture
def patch(client):
    def send(user, body):
        auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}
        url = f"/api/v1/labs/{Lab.objects.get(slug='vision').slug}/settings"
        return client.patch(url, body, content_type="application/json", **auth)

    return send


def test_a_new_lab_has_sane_limits_for_each_job_on_each_worker(make_lab):
    lab = make_lab("Fresh Lab", slug="fresh")
    assert (lab.job_tasks_max, lab.job_memory_max_mb, lab.job_log_max_mb) == (4096, 0, 100)


def test_an_admin_sets_the_job_limits_through_the_api(cast, patch):
    response = patch(
        cast.admin, {"job_tasks_max": 512, "job_memory_max_mb": 2048, "job_log_max_mb": 5}
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["job_tasks_max"], body["job_memory_max_mb"], body["job_log_max_mb"]) == (
        512,
        2048,
        5,
    )
    lab = Lab.objects.get(pk=cast.lab.pk)
    assert (lab.job_tasks_max, lab.job_memory_max_mb, lab.job_log_max_mb) == (512, 2048, 5)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"job_tasks_max": 8}, "greater than or equal to 16"),
        ({"job_memory_max_mb": 10}, "0 (90% of the worker's memory) or at least 32 mb"),
        ({"job_log_max_mb": 0}, "greater than or equal to 1"),
    ],
)
def test_limits_out_of_range_are_refused_naming_the_field_and_nothing_changes(
    cast, patch, body, fragment
):
    response = patch(cast.admin, body)
    assert response.status_code == 400, response.content
    assert list(response.json()["errors"]) == list(body)
    assert fragment in response.json()["detail"].lower()
    lab = Lab.objects.get(pk=cast.lab.pk)
    assert (lab.job_tasks_max, lab.job_memory_max_mb, lab.job_log_max_mb) == (4096, 0, 100)


def test_a_member_who_is_not_an_admin_cannot_change_them(cast, patch):
    assert patch(cast.member, {"job_tasks_max": 64}).status_code == 403
    assert Lab.objects.get(pk=cast.lab.pk).job_tasks_max == 4096


def test_the_settings_page_offers_the_limits(client, cast):
    client.force_login(cast.admin)
    page = client.get(f"/labs/{cast.lab.slug}/settings/").content.decode()
    for name in ("job_tasks_max", "job_memory_max_mb", "job_log_max_mb"):
        assert f'name="{name}"' in page
    response = client.post(
        f"/labs/{cast.lab.slug}/settings/",
        {
            "name": cast.lab.name,
            "policy_text": cast.lab.policy_text,
            "job_tasks_max": 1024,
            "job_memory_max_mb": 64,
            "job_log_max_mb": 1,
        },
    )
    assert response.status_code == 302
    lab = Lab.objects.get(pk=cast.lab.pk)
    assert (lab.job_tasks_max, lab.job_memory_max_mb, lab.job_log_max_mb) == (1024, 64, 1)


def test_every_start_carries_the_labs_limits_and_the_sites_retention(cast, settings):
    settings.PORTAL_JOB_FOLDER_RETENTION_DAYS = 7
    cast.lab.job_tasks_max, cast.lab.job_memory_max_mb, cast.lab.job_log_max_mb = 256, 64, 2
    limits = job_limits(cast.lab)
    data = wire.encode_start(wire.StartJob(job_id="j1", user="milo", argv=("true",), **limits))
    lines = data.decode().splitlines()
    assert lines[-5:] == [
        "tasks_max 256",
        "memory_max_mb 64",
        f"log_max_bytes {2 * 1024 * 1024}",
        "keep_days 7",
        "end",
    ]


@pytest.mark.parametrize(
    "fields",
    [{"tasks_max": 8}, {"memory_max_mb": 16}, {"log_max_bytes": 100}, {"keep_days": -1}],
)
def test_the_encoder_refuses_limits_the_worker_would_refuse(fields):
    with pytest.raises(ValueError):
        wire.encode_start(wire.StartJob(job_id="j1", user="milo", argv=("true",), **fields))


def test_a_settings_form_without_the_job_limits_keeps_the_labs_and_a_new_lab_gets_the_defaults(
    client, make_user
):
    from django.urls import reverse

    from tpus.models import Lab

    client.force_login(make_user(is_superuser=True, is_staff=True))
    make_user("boss@new.example")
    answer = client.post(
        reverse("lab_create"),
        {
            "name": "New Lab",
            "slug": "new-lab",
            "gcp_project_id": "new-lab-123",
            "zones": "us-central1-f",
            "policy_text": "Research only.",
            "admin_emails": "boss@new.example",
        },
    )
    assert answer.status_code == 302
    lab = Lab.objects.get(slug="new-lab")
    defaults = {f.name: f.default for f in Lab._meta.fields if f.name.startswith("job_")}
    assert {name: getattr(lab, name) for name in defaults} == defaults


def test_an_admin_sets_the_chips_a_person_may_hold_at_once_in_the_pool(cast, patch):
    response = patch(cast.admin, {"max_chips_per_person": 16})
    assert response.status_code == 200, response.content
    assert response.json()["max_chips_per_person"] == 16
    assert Lab.objects.get(pk=cast.lab.pk).max_chips_per_person == 16
    refused = patch(cast.admin, {"max_chips_per_person": -1})
    assert refused.status_code == 400 and list(refused.json()["errors"]) == ["max_chips_per_person"]
    assert Lab.objects.get(pk=cast.lab.pk).max_chips_per_person == 16

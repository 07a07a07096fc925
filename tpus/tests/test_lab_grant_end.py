"""The lab's TPU grant end date is a site admin's to set: it ends everyone's access to
the lab's VMs and the right to make or start them, and moving it later gives both back.
Its lab admins see it on the settings page and through the API, and cannot change it;
a site admin's change is audited with the old date and the new."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from tpus.models import AuditEvent, Lab
from tpus.services.labs import SITE_ADMIN_ONLY

ENDED = timezone.localdate() - dt.timedelta(days=1)


@pytest.fixture
def ended(cast):
    cast.lab.grant_end_date = ENDED
    cast.lab.save()
    return cast.lab


def _settings_post(lab, **changes) -> dict:
    """What the settings page's form posts, with ``changes`` on top."""
    fields = {
        "name": lab.name,
        "policy_text": lab.policy_text,
        "job_tasks_max": lab.job_tasks_max,
        "job_memory_max_mb": lab.job_memory_max_mb,
        "job_log_max_mb": lab.job_log_max_mb,
    }
    return {**fields, **changes}


def _api(client, user, method, url, body):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}
    return getattr(client, method)(url, body, content_type="application/json", **auth)


def test_a_lab_admin_sees_the_grant_end_date_but_has_no_field_for_it(client, cast, ended):
    client.force_login(cast.admin)
    page = client.get(reverse("lab_settings", args=[ended.slug])).content.decode()
    assert f"The lab's TPU grant ends on <strong>{ENDED:%-d %B %Y}</strong>" in page
    assert 'name="grant_end_date"' not in page
    client.force_login(cast.site_admin)
    page = client.get(reverse("lab_settings", args=[ended.slug])).content.decode()
    assert 'name="grant_end_date"' in page


def test_a_lab_admins_form_that_carries_the_date_is_refused_and_changes_nothing(
    client, cast, ended
):
    client.force_login(cast.admin)
    answer = client.post(
        reverse("lab_settings", args=[ended.slug]),
        _settings_post(ended, grant_end_date="2099-12-31", discoverable="on"),
    )
    assert answer.status_code == 403
    assert SITE_ADMIN_ONLY.replace("'", "&#x27;") in answer.content.decode()
    lab = Lab.objects.get(pk=ended.pk)
    assert (lab.grant_end_date, lab.discoverable) == (ENDED, False)
    assert not AuditEvent.objects.filter(action="lab.updated").exists()


def test_a_lab_admins_api_call_that_carries_the_date_is_refused_and_changes_nothing(
    client, cast, ended
):
    url = f"/api/v1/labs/{ended.slug}/settings"
    for body in ({"grant_end_date": "2099-12-31"}, {"grant_end_date": None}):
        answer = _api(client, cast.admin, "patch", url, body)
        assert answer.status_code == 403 and answer.json() == {"detail": SITE_ADMIN_ONLY}
    assert Lab.objects.get(pk=ended.pk).grant_end_date == ENDED
    # They read it.
    assert _api(client, cast.admin, "get", url, None).json()["grant_end_date"] == str(ENDED)


def test_a_lab_admins_other_settings_keep_the_date(client, cast, ended):
    client.force_login(cast.admin)
    answer = client.post(
        reverse("lab_settings", args=[ended.slug]), _settings_post(ended, discoverable="on")
    )
    assert answer.status_code == 302
    lab = Lab.objects.get(pk=ended.pk)
    assert (lab.grant_end_date, lab.discoverable) == (ENDED, True)


def test_a_site_admin_moves_the_date_and_the_audit_has_the_old_date_and_the_new(
    client, cast, ended
):
    client.force_login(cast.site_admin)
    answer = client.post(
        reverse("lab_settings", args=[ended.slug]),
        _settings_post(
            ended, gcp_project_id=ended.gcp_project_id, zones=", ".join(ended.zones),
            grant_end_date="2027-02-28",
        ),
    )  # fmt: skip
    assert answer.status_code == 302
    assert Lab.objects.get(pk=ended.pk).grant_end_date == dt.date(2027, 2, 28)
    event = AuditEvent.objects.get(action="lab.updated")
    assert event.actor == cast.site_admin
    assert event.data == {
        "fields": ["grant_end_date"],
        "grant_end_date": {"old": ENDED.isoformat(), "new": "2027-02-28"},
    }
    assert event.summary == f"TPU grant end date: {ENDED:%-d %B %Y} → 28 February 2027"

    url = f"/api/v1/labs/{ended.slug}/settings"
    assert _api(client, cast.site_admin, "patch", url, {"grant_end_date": None}).status_code == 200
    last = AuditEvent.objects.filter(action="lab.updated").latest("pk")
    assert last.data["grant_end_date"] == {"old": "2027-02-28", "new": None}
    assert Lab.objects.get(pk=ended.pk).grant_end_date is None

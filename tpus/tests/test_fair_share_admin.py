"""What a lab admin sees and sets of the pool's fair share: each person's share,
recent use and running chips on the lab's admin page, a member's share and the
lab's half-life (checked, audited, within the lab only), and the limit of jobs one
person may have waiting at once (a job past it is refused, nothing stored)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from tpus.models import AuditEvent, FairShare, Job, Lab, TpuVm
from tpus.services import scheduler
from tpus.services.jobs import JobSpec, Kind, submit_job, submit_pool_job
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job

scene = jobs_support.scene
SPEC = JobSpec(args=["python3", "train.py"])


@pytest.fixture
def quiet(monkeypatch):
    """Placement's VM passes are not run."""
    monkeypatch.setattr(scheduler.queue, "advance_jobs", lambda vm_id: None)


def share_url(lab, membership):
    return reverse("membership_share", args=[lab.slug, membership.pk])


# --- the admin page -------------------------------------------------------------------


def test_the_admin_page_shows_each_persons_share_recent_use_and_running_chips(scene, client):
    now = timezone.now()
    FairShare.objects.create(
        lab=scene.lab, user=scene.milo, share=Decimal("2.5"), use=12.34, decayed_at=now
    )
    make_job(scene.vm, scene.ann, "running", started_at=now - dt.timedelta(hours=2))
    client.force_login(scene.admin)
    page = client.get(reverse("lab_admin", args=[scene.lab.slug])).content.decode()
    milo = page[page.index("milo@vision.example") :]
    milo = milo[: milo.index("</tr>")]
    assert ">2.5</a>" in milo and "<td>12.3</td>" in milo and "<td>0</td>" in milo
    ann = page[page.index("ann@vision.example") :]
    ann = ann[: ann.index("</tr>")]
    # ann's v4-8 job: 4 chips for two hours, running.
    assert ">1</a>" in ann and "<td>8.0</td>" in ann and "<td>4</td>" in ann


def test_the_member_page_shows_the_persons_figures_and_the_share_form(scene, client):
    FairShare.objects.create(lab=scene.lab, user=scene.milo, use=7.0, share=Decimal(3))
    membership = scene.lab.memberships.get(user=scene.milo)
    client.force_login(scene.admin)
    page = client.get(reverse("member_grant", args=[scene.lab.slug, membership.pk]))
    text = page.content.decode()
    assert "Recent use <strong>7.0 chip-hours</strong>" in text
    assert "share <strong>3</strong>" in text
    assert share_url(scene.lab, membership) in text


def test_a_member_sees_their_own_share_and_recent_use_on_the_labs_page(scene, client):
    FairShare.objects.create(lab=scene.lab, user=scene.milo, use=42.0, share=Decimal("1.5"))
    FairShare.objects.create(lab=scene.lab, user=scene.ann, use=99.0)
    client.force_login(scene.milo)
    page = client.get(reverse("lab_detail", args=[scene.lab.slug])).content.decode()
    mine = page[page.index('id="my-share"') :]
    assert "<strong>42.0 chip-hours</strong>" in mine and "<strong>1.5</strong>" in mine
    assert "99.0" not in page and "ann@vision.example" not in page


# --- setting a share -------------------------------------------------------------------


def test_a_lab_admin_sets_a_members_share_and_it_is_audited(scene, client):
    membership = scene.lab.memberships.get(user=scene.milo)
    client.force_login(scene.admin)
    answer = client.post(share_url(scene.lab, membership), {"share": "2.5"})
    assert answer.status_code == 302
    assert FairShare.objects.get(lab=scene.lab, user=scene.milo).share == Decimal("2.5")
    event = AuditEvent.objects.get(action="membership.share_set")
    assert event.actor == scene.admin and event.target_user == scene.milo
    assert event.lab == scene.lab and event.data == {"share": {"old": "1.00", "new": "2.50"}}
    client.post(share_url(scene.lab, membership), {"share": "2.50"})  # the same: nothing
    assert AuditEvent.objects.filter(action="membership.share_set").count() == 1


@pytest.mark.parametrize(
    "typed, words",
    [
        ("0", "greater than or equal to 0.01"),
        ("-1", "greater than or equal to 0.01"),
        ("1001", "less than or equal to 1000"),
        ("1.234", "no more than 2 decimal places"),
        ("many", "Enter a number"),
        ("", "This field is required"),
    ],
)
def test_a_share_out_of_range_is_refused_with_the_reason_and_nothing_changes(
    scene, client, typed, words
):
    FairShare.objects.create(lab=scene.lab, user=scene.milo, share=Decimal(2))
    membership = scene.lab.memberships.get(user=scene.milo)
    client.force_login(scene.admin)
    answer = client.post(share_url(scene.lab, membership), {"share": typed}, follow=True)
    assert words in answer.content.decode()
    assert FairShare.objects.get(lab=scene.lab, user=scene.milo).share == Decimal(2)
    assert not AuditEvent.objects.filter(action="membership.share_set").exists()


def test_a_member_who_is_not_an_admin_cannot_set_a_share(scene, client):
    membership = scene.lab.memberships.get(user=scene.milo)
    client.force_login(scene.milo)
    assert client.post(share_url(scene.lab, membership), {"share": "50"}).status_code == 403
    assert not FairShare.objects.exists()


def test_another_labs_member_is_a_404_for_a_lab_admin(scene, cast, client):
    theirs = cast.other_membership
    client.force_login(scene.admin)
    # Their membership through this lab's address, and their lab's address itself.
    assert client.post(share_url(scene.lab, theirs), {"share": "5"}).status_code == 404
    assert client.post(share_url(cast.other_lab, theirs), {"share": "5"}).status_code == 404
    client.force_login(cast.outsider)  # an admin of the other lab only
    mine = scene.lab.memberships.get(user=scene.milo)
    assert client.post(share_url(scene.lab, mine), {"share": "5"}).status_code == 404
    assert not FairShare.objects.exists()


def test_the_api_reads_and_sets_a_members_share(scene, cast, client):
    membership = scene.lab.memberships.get(user=scene.milo)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(scene.admin, 'test')[1]}"}
    url = f"/api/v1/labs/vision/memberships/{membership.pk}/share"
    assert client.get(url, **auth).json() == {
        "user": "milo@vision.example", "share": 1.0, "recent_use": 0.0, "running_chips": 0
    }  # fmt: skip
    answer = client.post(url, {"share": 2.5}, content_type="application/json", **auth)
    assert answer.status_code == 200 and answer.json()["share"] == 2.5
    refused = client.post(url, {"share": "0"}, content_type="application/json", **auth)
    assert refused.status_code == 400 and list(refused.json()["errors"]) == ["share"]
    assert FairShare.objects.get(user=scene.milo).share == Decimal("2.5")
    theirs = f"/api/v1/labs/vision/memberships/{cast.other_membership.pk}/share"
    assert (
        client.post(theirs, {"share": 3}, content_type="application/json", **auth).status_code
        == 404
    )


# --- the half-life and the waiting limit in the lab's settings --------------------------


@pytest.fixture
def patch(client):
    def send(user, body):
        auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}
        return client.patch(
            "/api/v1/labs/vision/settings", body, content_type="application/json", **auth
        )

    return send


def test_a_lab_admin_sets_the_half_life_and_the_waiting_limit_on_the_settings_page(scene, client):
    client.force_login(scene.admin)
    url = reverse("lab_settings", args=[scene.lab.slug])
    form = client.get(url).content.decode()
    assert "half-life of recent use (days)" in form.lower()
    assert "jobs waiting at once per person" in form.lower()
    answer = client.post(
        url,
        {"name": "Vision Lab", "policy_text": scene.lab.policy_text,
         "fair_share_half_life_days": "3.5", "max_waiting_jobs_per_person": "4"},
    )  # fmt: skip
    assert answer.status_code == 302
    lab = Lab.objects.get(pk=scene.lab.pk)
    assert lab.fair_share_half_life_days == Decimal("3.5") and lab.max_waiting_jobs_per_person == 4
    event = AuditEvent.objects.get(action="lab.updated")
    assert set(event.data["fields"]) == {"fair_share_half_life_days", "max_waiting_jobs_per_person"}


@pytest.mark.parametrize(
    "body",
    [
        {"fair_share_half_life_days": 0},
        {"fair_share_half_life_days": 400},
        {"max_waiting_jobs_per_person": -1},
    ],
)
def test_a_half_life_or_waiting_limit_out_of_range_is_refused_and_nothing_changes(
    scene, patch, body
):
    response = patch(scene.admin, body)
    assert response.status_code == 400 and list(response.json()["errors"]) == list(body)
    lab = Lab.objects.get(pk=scene.lab.pk)
    assert lab.fair_share_half_life_days == Decimal(7) and lab.max_waiting_jobs_per_person == 0
    assert not AuditEvent.objects.filter(action="lab.updated").exists()


def test_the_api_gives_and_takes_the_half_life_and_the_waiting_limit(scene, patch):
    response = patch(
        scene.admin, {"fair_share_half_life_days": 14, "max_waiting_jobs_per_person": 9}
    )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["fair_share_half_life_days"] == 14 and body["max_waiting_jobs_per_person"] == 9
    assert patch(scene.milo, {"fair_share_half_life_days": 1}).status_code == 403


# --- the waiting limit ----------------------------------------------------------------------

LIMIT_WORDS = (
    "You already have 2 jobs waiting in Vision Lab; this lab allows 2 waiting at once per "
    "person. Cancel one or wait for one to start."
)


@pytest.fixture
def limited(scene, quiet):
    """Vision Lab allows 2 waiting jobs a person; tpu5 is busy, and milo has one job
    waiting for it and one for any v4-8."""
    Lab.objects.filter(pk=scene.lab.pk).update(max_waiting_jobs_per_person=2)
    scene.lab.refresh_from_db()
    TpuVm.objects.filter(pk=scene.vm.pk).update(state="READY")
    make_job(scene.vm, scene.ann, "running")
    submit_job(scene.milo, scene.vm, SPEC)
    submit_pool_job(scene.milo, scene.lab, Kind("v4-8"), SPEC)
    return scene


def test_a_job_past_the_waiting_limit_is_refused_and_nothing_is_stored(limited):
    jobs, events = Job.objects.count(), AuditEvent.objects.count()
    with pytest.raises(ValidationError) as refused:
        submit_pool_job(limited.milo, limited.lab, Kind("v4-8"), SPEC)
    assert refused.value.messages == [LIMIT_WORDS]
    with pytest.raises(ValidationError, match="2 jobs waiting in Vision Lab"):
        submit_job(limited.milo, limited.vm, SPEC)
    with pytest.raises(ValidationError, match="2 jobs waiting in Vision Lab"):
        submit_pool_job(limited.milo, limited.lab, Kind("v4-8"), SPEC, dry_run=True)
    assert (Job.objects.count(), AuditEvent.objects.count()) == (jobs, events)
    # Someone else's jobs are theirs: ann may still queue hers.
    submit_pool_job(limited.ann, limited.lab, Kind("v4-8"), SPEC)


def test_the_api_refuses_a_job_past_the_waiting_limit_with_the_numbers(limited, client):
    jobs = Job.objects.count()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(limited.milo, 'test')[1]}"}
    for path in ("/api/v1/labs/vision/jobs", "/api/v1/labs/vision/jobs/validate"):
        answer = client.post(
            path,
            {"accelerator_type": "v4-8", "args": ["python3", "train.py"]},
            content_type="application/json",
            **auth,
        )
        assert answer.status_code == 400 and answer.json()["detail"] == LIMIT_WORDS
    assert Job.objects.count() == jobs


def test_the_job_page_refuses_a_job_past_the_waiting_limit_with_the_numbers(limited, client):
    jobs = Job.objects.count()
    client.force_login(limited.milo)
    answer = client.post(
        reverse("job_submit", args=[limited.lab.slug, limited.vm.pk]),
        {"command": "python3 train.py", "where": "pool"},
    )
    assert answer.status_code == 200 and LIMIT_WORDS in answer.content.decode()
    assert Job.objects.count() == jobs


def test_a_job_that_no_longer_waits_makes_room_under_the_waiting_limit(limited):
    Job.objects.filter(user=limited.milo, vm=limited.vm).update(state="cancelled")
    submit_pool_job(limited.milo, limited.lab, Kind("v4-8"), SPEC)

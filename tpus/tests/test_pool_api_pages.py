"""The pool through the API and the pages: a job for any free v4-8 is queued, says why
it waits and where it is in line, is found and cancelled by its id alone, and is
another lab's 404; the VM page's "Run on any free v4-8" queues one."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from tpus.models import Job, TpuVm
from tpus.services import scheduler
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job

scene = jobs_support.scene
BODY = {"accelerator_type": "v4-8", "args": ["python3", "train.py"]}


@pytest.fixture
def api(client):
    def call(user, method, path, body=None):
        token = create_token(user, "t")[1]
        return getattr(client, method)(
            f"/api/v1{path}",
            body,
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
        )

    return call


@pytest.fixture
def busy(scene, monkeypatch):
    """tpu5 READY and running ann's job: a job for any v4-8 waits."""
    monkeypatch.setattr(scheduler.queue, "advance_jobs", lambda vm_id: None)
    TpuVm.objects.filter(pk=scene.vm.pk).update(state="READY")
    make_job(scene.vm, scene.ann, "running")
    return scene


def test_a_job_for_any_free_v4_8_waits_and_says_why(busy, api):
    first = api(busy.ann, "post", "/labs/vision/jobs", BODY)
    response = api(busy.milo, "post", "/labs/vision/jobs", {**BODY, "zones": ["us-central1-f"]})
    assert first.status_code == response.status_code == 201, response.content
    job = response.json()
    assert job["vm_id"] is None and job["vm"] is None and job["lab"] == "vision"
    assert job["accelerator_type"] == "v4-8" and job["zones"] == ["us-central1-f"]
    # ann's running job is recent use, milo has none: milo's job goes first.
    assert job["position"] == 1
    assert job["reason"] == "All 1 v4-8 in us-central1-f you may use is busy; 0 jobs before yours."
    assert job["url"].endswith(f"/labs/vision/jobs/{job['id']}/")
    listed = api(busy.milo, "get", "/labs/vision/jobs").json()
    assert [j["id"] for j in listed] == [job["id"], first.json()["id"]]
    assert listed[0]["reason"] == job["reason"] and listed[0]["vm"] is None
    assert "your recent use is above your share" in listed[1]["reason"]
    mine = api(busy.milo, "get", f"/me/jobs/{job['id']}").json()
    assert mine["id"] == job["id"] and mine["vm_id"] is None
    cancelled = api(busy.milo, "post", f"/labs/vision/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    again = api(busy.milo, "post", f"/labs/vision/jobs/{job['id']}/cancel")
    assert again.status_code == 409


def test_a_job_for_a_kind_is_refused_with_the_reason_and_nothing_is_stored(busy, api):
    none = api(busy.milo, "post", "/labs/vision/jobs", {**BODY, "accelerator_type": "v4-32"})
    assert none.status_code == 403 and "no v4-32 of Vision Lab" in none.json()["detail"]
    bad = api(
        busy.milo,
        "post",
        "/labs/vision/jobs",
        {**BODY, "accelerator_type": "big", "provisioning": "cheap", "cwd": "/etc"},
    )
    assert bad.status_code == 400
    assert {"accelerator_type", "provisioning"} <= set(bad.json()["errors"])
    check = api(busy.milo, "post", "/labs/vision/jobs/validate", BODY)
    assert check.status_code == 200 and check.json()["ok"]
    assert not Job.objects.filter(vm__isnull=True).exists()


def test_another_labs_pool_and_jobs_are_a_404(busy, api, cast):
    job = api(busy.milo, "post", "/labs/vision/jobs", BODY).json()
    outsider = cast.outsider
    assert api(outsider, "get", f"/labs/vision/jobs/{job['id']}").status_code == 404
    assert api(outsider, "get", "/labs/vision/jobs").status_code == 404
    assert api(outsider, "post", "/labs/vision/jobs", BODY).status_code == 404
    assert api(outsider, "get", f"/labs/other/jobs/{job['id']}").status_code == 404
    # Another member of the lab does not see someone else's job page by its id.
    assert api(busy.ann, "get", f"/labs/vision/jobs/{job['id']}").status_code == 404
    assert api(busy.admin, "get", f"/labs/vision/jobs/{job['id']}").status_code == 200


def test_run_on_any_free_v4_8_from_the_vm_page(busy, client):
    client.force_login(busy.milo)
    page = client.get(reverse("vm_detail", args=["vision", busy.vm.pk])).content.decode()
    assert "Run on any free v4-8" in page
    response = client.post(
        reverse("job_submit", args=["vision", busy.vm.pk]),
        {"command": "python3 train.py", "where": "pool", "use_tcmalloc": "on"},
    )
    job = Job.objects.get(vm__isnull=True)
    assert response.status_code == 302 and response["Location"] == reverse(
        "lab_job", args=["vision", job.pk]
    )
    page = client.get(response["Location"]).content.decode()
    assert "1st in line" in page
    assert "All 1 v4-8 you may use is busy; 0 jobs before yours." in page
    # Placed: its page is its VM's job page.
    Job.objects.filter(vm=busy.vm, state="running").update(state="succeeded")
    scheduler.place(busy.lab.pk)
    placed = client.get(reverse("lab_job", args=["vision", job.pk]))
    assert placed["Location"] == reverse("job_detail", args=["vision", busy.vm.pk, job.pk])


def test_a_pool_job_run_again_goes_back_to_the_pool(busy, client, api):
    job = api(busy.milo, "post", "/labs/vision/jobs", BODY).json()
    Job.objects.filter(vm=busy.vm, state="running").update(state="succeeded")
    scheduler.place(busy.lab.pk)
    Job.objects.filter(pk=job["id"]).update(state="succeeded")
    make_job(busy.vm, busy.ann, "running")
    client.force_login(busy.milo)
    response = client.post(reverse("job_rerun", args=["vision", busy.vm.pk, job["id"]]))
    new = Job.objects.get(rerun_of_id=job["id"])
    assert new.vm_id is None and new.accelerator_type == "v4-8"
    assert response["Location"] == reverse("lab_job", args=["vision", new.pk])
    again = api(busy.milo, "post", f"/labs/vision/vms/{busy.vm.pk}/jobs/{job['id']}/rerun")
    assert again.status_code == 201 and again.json()["vm_id"] is None
    assert again.json()["url"].endswith(f"/labs/vision/jobs/{again.json()['id']}/")


def test_the_pools_list_gives_each_jobs_place_in_line_and_where_a_moved_one_came_from(busy, api):
    first = api(busy.ann, "post", "/labs/vision/jobs", BODY).json()
    second = api(busy.milo, "post", "/labs/vision/jobs", BODY).json()
    # A job of milo's back from a preempted VM: at the head of the line.
    back = api(busy.milo, "post", "/labs/vision/jobs", BODY).json()
    Job.objects.filter(pk=back["id"]).update(
        attempt=2, moved_from="tpu7", moved_why="preempted", returned_at=timezone.now()
    )
    listed = {j["id"]: j for j in api(busy.milo, "get", "/labs/vision/jobs").json()}
    assert [listed[j["id"]]["position"] for j in (back, second, first)] == [1, 2, 3]
    assert (listed[back["id"]]["attempt"], listed[back["id"]]["moved_from"]) == (2, "tpu7")
    assert listed[back["id"]]["moved_why"] == "preempted"
    assert (listed[first["id"]]["attempt"], listed[first["id"]]["moved_from"]) == (1, "")
    # The VM's own list says the same of a job run again there.
    Job.objects.filter(pk=back["id"]).update(vm=busy.vm, placed_at=timezone.now())
    rows = api(busy.milo, "get", f"/labs/vision/vms/{busy.vm.pk}/jobs").json()["items"]
    [row] = [r for r in rows if r["id"] == back["id"]]
    assert (row["attempt"], row["moved_from"], row["moved_why"]) == (2, "tpu7", "preempted")
    # Another lab's member sees none of it.
    assert api(busy.admin, "get", "/labs/other/jobs").status_code == 404

"""What a job's page says when a running job prints nothing (a pod whose workers cannot
reach worker 0's coordinator waits without a line), and the note on the job form of a
portal whose pre-flight does not ask for libtpu (the demo's fake chips)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from tpus.models import Grant
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


def _live(client, job) -> str:
    url = reverse("job_live", args=[job.vm.lab.slug, job.vm_id, job.pk])
    return client.get(url).content.decode()


def _silent_pod_job(scene, *, started_seconds_ago: int):
    vm = make_vm(scene.lab, "pod1", workers=4)
    vm.workers.filter(index=0).update(internal_ip="10.128.0.2")
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    started = timezone.now() - dt.timedelta(seconds=started_seconds_ago)
    job = make_job(vm, scene.milo, "running", started_at=started)
    job.parts.update(log_tail="", log_size=0, started_at=started)
    return job


def test_a_pod_job_silent_for_minutes_names_the_coordinator_its_workers_wait_for(
    client, scene, settings
):
    settings.PORTAL_JOB_COORDINATOR_PORT = 8476
    job = _silent_pod_job(scene, started_seconds_ago=150)
    client.force_login(scene.milo)
    body = _live(client, job)
    note = body[body.index('id="job-quiet"') :].split("</p>")[0]
    assert "No output yet from any worker after 15" in note
    assert "cannot reach worker 0's coordinator at <code>10.128.0.2:8476</code>" in note


def test_only_the_silent_workers_are_named_and_a_single_host_is_not_told_about_pods(client, scene):
    job = _silent_pod_job(scene, started_seconds_ago=90)
    job.parts.filter(index__in=[0, 2]).update(log_tail="step 1\n", log_size=7)
    client.force_login(scene.milo)
    assert "No output yet from workers 1, 3 after 9" in _live(client, job)

    single = make_job(scene.vm, scene.milo, "running")
    single.parts.update(log_tail="", log_size=0)
    body = _live(client, single)
    assert "No output yet from any worker after 3" in body
    assert "coordinator" not in body and "python -u" in body


def test_a_job_that_printed_or_started_a_moment_ago_gets_no_note(client, scene):
    fresh = _silent_pod_job(scene, started_seconds_ago=20)
    client.force_login(scene.milo)
    assert 'id="job-quiet"' not in _live(client, fresh)
    talking = make_job(scene.vm, scene.milo, "running")
    assert 'id="job-quiet"' not in _live(client, talking)
    ended = make_job(scene.vm, scene.milo, "succeeded")
    ended.parts.update(log_tail="", log_size=0)
    assert 'id="job-quiet"' not in _live(client, ended)


@pytest.mark.parametrize("required", [True, False])
def test_the_job_forms_say_when_the_pre_flight_does_not_ask_for_libtpu(
    client, scene, settings, required
):
    settings.PORTAL_JOB_REQUIRE_LIBTPU = required
    client.force_login(scene.milo)
    pages = [
        client.get(reverse("vm_detail", args=[scene.lab.slug, scene.vm.pk])),
        client.get(reverse("job_submit", args=[scene.lab.slug, scene.vm.pk])),
    ]
    for page in pages:
        body = page.content.decode()
        assert 'name="command"' in body
        assert ('id="job-libtpu-note"' in body) is not required
        if not required:
            assert "<code>PORTAL_JOB_REQUIRE_LIBTPU</code> is off" in body
            assert "chips are fake" in body

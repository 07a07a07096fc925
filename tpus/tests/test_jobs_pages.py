"""The pages for jobs: the Jobs section of a VM's page, running a job, a job's page with
its live logs, cancel and run again. Jobs are rows made directly; a submitted job's
pass is queued after commit, which these tests (inside one transaction) never reach:
the queued callback is captured, not run."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from tpus.models import AuditEvent, Grant, Job
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


def _vm_page(client, scene):
    return client.get(reverse("vm_detail", args=[scene.lab.slug, scene.vm.pk]))


def _submit_url(scene):
    return reverse("job_submit", args=[scene.lab.slug, scene.vm.pk])


def _job_url(job, name="job_detail"):
    return reverse(name, args=[job.vm.lab.slug, job.vm_id, job.pk])


# --- the VM page ----------------------------------------------------------------------


def test_a_free_tpu_shows_as_free_with_the_form_for_someone_with_access(client, scene):
    client.force_login(scene.milo)
    body = _vm_page(client, scene).content.decode()
    assert 'id="jobs"' in body
    assert "Free</span>" in body
    assert f'action="{_submit_url(scene)}"' in body
    assert re.search(r"<input[^>]*name=\"use_tcmalloc\"[^>]*checked", body)
    assert "No job is waiting." in body
    assert 'hx-get="' + reverse("vm_jobs", args=[scene.lab.slug, scene.vm.pk]) not in body


def test_someone_whose_access_is_not_active_sees_the_jobs_but_no_form(client, scene):
    Grant.objects.filter(user=scene.milo).update(state="pending")
    make_job(scene.vm, scene.ann, "running")
    client.force_login(scene.milo)
    body = _vm_page(client, scene).content.decode()
    assert "ann</strong>" in body
    assert f'action="{_submit_url(scene)}"' not in body
    assert "once you have active access" in body


def test_the_page_says_who_runs_what_since_when_and_who_waits_in_which_order(client, scene):
    running = make_job(scene.vm, scene.ann, "running", args=["python3", "big.py"])
    first = make_job(
        scene.vm,
        scene.milo,
        "blocked",
        queued_at=timezone.now() - timezone.timedelta(minutes=3),
        reason="The TPU is in use outside the portal: worker 0 (tpu5-w0): chip_holder: x",
    )
    second = make_job(scene.vm, scene.ann, "queued", args=["python3", "next.py"])
    client.force_login(scene.milo)
    body = _vm_page(client, scene).content.decode()
    now = body[body.index('id="tpu-now"') :]
    assert "ann</strong>" in now and "big.py" in now and "running since" in now
    # Someone else's running job: who and what, but no link to its page.
    assert _job_url(running) not in body
    queue = body[body.index('id="job-queue"') :]
    assert queue.index(f"queued-job-{first.pk}") < queue.index(f"queued-job-{second.pk}")
    assert "Blocked: the TPU is held outside the portal" in queue
    assert "in use outside the portal: worker 0" in queue
    assert "next.py" in queue
    assert "Queue: 2 waiting" in body
    assert _job_url(first) in queue and _job_url(second) not in queue
    # The live part polls while something runs or waits.
    assert 'hx-get="' + reverse("vm_jobs", args=[scene.lab.slug, scene.vm.pk]) in body


def test_processes_holding_the_tpu_outside_the_portal_are_named(client, scene):
    checked = timezone.now() - timezone.timedelta(minutes=2)
    scene.vm.outside_holders = [
        {
            "worker": 0,
            "device": "/dev/accel0",
            "pid": "4242",
            "user": "ann",
            "command": "python3 x.py",
        }
    ]
    scene.vm.usage_checked_at = checked
    scene.vm.save()
    client.force_login(scene.milo)
    body = client.get(reverse("vm_jobs", args=[scene.lab.slug, scene.vm.pk])).content.decode()
    assert "Held outside the portal" in body
    holders = body[body.index('id="outside-holders"') :]
    for text in ("/dev/accel0", "4242", "ann", "python3 x.py", "<td>0</td>"):
        assert text in holders
    assert checked.strftime("%-d %b %H:%M") in body


def test_admins_see_everyones_recent_jobs_and_members_only_their_own(client, scene):
    mine = make_job(scene.vm, scene.milo, "succeeded")
    theirs = make_job(scene.vm, scene.ann, "failed")
    client.force_login(scene.milo)
    body = _vm_page(client, scene).content.decode()
    assert f"recent-job-{mine.pk}" in body and f"recent-job-{theirs.pk}" not in body
    client.force_login(scene.admin)
    body = _vm_page(client, scene).content.decode()
    assert f"recent-job-{mine.pk}" in body and f"recent-job-{theirs.pk}" in body


# --- running a job --------------------------------------------------------------------


def test_a_command_is_queued_and_its_pass_waits_for_the_commit(
    client, scene, django_capture_on_commit_callbacks
):
    client.force_login(scene.milo)
    with django_capture_on_commit_callbacks() as callbacks:
        response = client.post(
            _submit_url(scene),
            {
                "command": "python3 train.py --name 'my run'",
                "python": "~/venv",
                "cwd": "work",
                "env": "XLA_FLAGS=--xla_dump_to=/tmp/x\n# a comment\nSEED=1",
                "time_limit_minutes": "90",
                "notify": "on",
                "use_tcmalloc": "on",
            },
        )
    job = Job.objects.get()
    assert response.status_code == 302
    assert response["Location"] == _job_url(job)
    assert job.user == scene.milo and job.state == "queued"
    assert job.args == ["python3", "train.py", "--name", "my run"] and job.script == ""
    assert job.python == "/home/milo/venv" and job.cwd == "/home/milo/work"
    assert job.env == [["XLA_FLAGS", "--xla_dump_to=/tmp/x"], ["SEED", "1"]]
    assert job.time_limit_minutes == 90 and job.notify and job.use_tcmalloc
    assert AuditEvent.objects.filter(action="job.submitted").count() == 1
    assert len(callbacks) == 1  # the VM's pass, queued for after the commit


def test_a_script_runs_with_its_arguments_and_tcmalloc_can_be_left_out(client, scene):
    client.force_login(scene.milo)
    response = client.post(
        _submit_url(scene), {"script": "src/train.py", "script_args": "--lr 0.1 'a b'"}
    )
    assert response.status_code == 302
    job = Job.objects.get()
    assert job.script == "/home/milo/src/train.py"
    assert job.args == ["--lr", "0.1", "a b"]
    assert job.argv == ["python3", "/home/milo/src/train.py", "--lr", "0.1", "a b"]
    assert not job.use_tcmalloc and not job.notify and job.time_limit_minutes is None


@pytest.mark.parametrize(
    "data, field, message",
    [
        ({}, "command", "Give the command to run, or a script."),
        ({"command": "python3 x.py", "script": "x.py"}, "command", "not both"),
        ({"command": "python3 'x.py"}, "command", "The command cannot be read"),
        ({"script": "x.py", "script_args": '"unclosed'}, "script_args", "cannot be read"),
        ({"command": "FOO=1 python3"}, "command", "not NAME=value"),
        ({"script": "../../etc/passwd"}, "script", "may not contain &#x27;..&#x27;"),
        ({"script": "/opt/x.py"}, "script", "must be inside your home, /home/milo"),
        ({"command": "true", "python": "/usr"}, "python", "must be inside your home"),
        ({"command": "true", "cwd": "/tmp"}, "cwd", "must be inside your home"),
        ({"command": "true", "env": "JUSTANAME"}, "env", "Line 1 is not NAME=value."),
        ({"command": "true", "env": "LD_LIBRARY_PATH=/x"}, "env", "is set by the portal"),
        ({"command": "true", "env": "A=1\nA=2"}, "env", "may be set once"),
        ({"command": "true", "env": "1A=x"}, "env", "letters, digits"),
        ({"command": "true", "time_limit_minutes": "0"}, "time_limit_minutes", "greater than"),
        ({"command": "true", "time_limit_minutes": "99999"}, "time_limit_minutes", "less than"),
    ],
)
def test_bad_input_is_shown_on_its_field_and_stores_nothing(client, scene, data, field, message):
    client.force_login(scene.milo)
    response = client.post(_submit_url(scene), data)
    assert response.status_code == 200
    body = response.content.decode()
    errors = body[body.index(f'id="field-{field}"') :]
    errors = errors[: errors.index("</div>\n", errors.index("errorlist"))]
    assert message in errors, errors
    assert not Job.objects.exists()
    # What was typed stays in the form.
    for value in data.values():
        assert escape(value) in body


def test_without_active_access_the_job_is_refused_with_the_reason(client, scene):
    Grant.objects.filter(user=scene.milo).update(state="pending")
    client.force_login(scene.milo)
    response = client.post(_submit_url(scene), {"command": "python3 train.py"})
    assert response.status_code == 403
    assert "You need active access to tpu5 to run jobs on it" in response.content.decode()
    assert not Job.objects.exists()


def test_an_admin_without_a_grant_cannot_run_jobs(client, scene):
    client.force_login(scene.admin)
    response = client.post(_submit_url(scene), {"command": "python3 train.py"})
    assert response.status_code == 403
    assert not Job.objects.exists()


def test_someone_who_cannot_see_the_vm_gets_a_404(client, cast, scene):
    client.force_login(cast.outsider)
    assert client.post(_submit_url(scene), {"command": "true"}).status_code == 404
    assert client.get(reverse("vm_jobs", args=[scene.lab.slug, scene.vm.pk])).status_code == 404
    assert not Job.objects.exists()


def test_a_full_queue_refuses_one_more_job_and_says_how_many_are_allowed(client, scene):
    scene.lab.max_queued_jobs = 2
    scene.lab.save()
    make_job(scene.vm, scene.milo, "queued")
    make_job(scene.vm, scene.milo, "blocked")
    make_job(scene.vm, scene.ann, "queued")  # someone else's do not count
    client.force_login(scene.milo)
    response = client.post(_submit_url(scene), {"command": "python3 train.py"})
    assert response.status_code == 200
    assert "You already have 2 job(s) waiting on tpu5; this lab allows 2." in (
        response.content.decode()
    )
    assert Job.objects.count() == 3


# --- a job's page ---------------------------------------------------------------------


def test_the_owner_sees_the_job_with_each_workers_log_and_how_to_follow_it(client, scene):
    vm = make_vm(scene.lab, "pod1", workers=2)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    job = make_job(vm, scene.milo, "running", env=[["SEED", "7"]], python="/home/milo/venv")
    job.parts.filter(index=1).update(log_tail="step 1\nstep 2\n", log_size=2048)
    client.force_login(scene.milo)
    body = client.get(_job_url(job)).content.decode()
    assert "python3 train.py --steps 10" in body
    assert "SEED=7" in body and "/home/milo/venv" in body
    assert "step 1\nstep 2" in body and "hello from worker 0" in body
    for index in (0, 1):
        assert f"ssh pod1-w{index} tail -f /var/lib/tpu-portal/jobs/{job.host_id}/log" in body
        assert reverse("job_log", args=[scene.lab.slug, vm.pk, job.pk, index]) in body
    assert "2.0\xa0KB" in body
    # Live while running: the partial is polled every 2 s.
    assert f'hx-get="{_job_url(job, "job_live")}" hx-trigger="every 2s"' in body
    assert "Cancel</button>" in body and "Run again" not in body


def test_a_single_worker_vm_is_followed_with_its_own_name(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.milo)
    body = client.get(_job_url(job)).content.decode()
    assert f"ssh tpu5 tail -f /var/lib/tpu-portal/jobs/{job.host_id}/log" in body


def test_the_live_part_stops_polling_once_the_job_ended(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.milo)
    live = client.get(_job_url(job, "job_live"), HTTP_HX_REQUEST="true").content.decode()
    assert live.startswith('<div id="job-live" hx-get=') and "every 2s" in live
    assert "<html" not in live
    Job.objects.filter(pk=job.pk).update(state="succeeded", ended_at=timezone.now())
    job.parts.update(state="ended", exit_status=0, ended_at=timezone.now())
    live = client.get(_job_url(job, "job_live")).content.decode()
    assert "hx-trigger" not in live
    assert "Succeeded" in live and "exit 0" in live and "Run again" in live


def test_the_log_on_the_page_is_bounded_to_its_last_lines(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    job.parts.update(log_tail="".join(f"line {n}\n" for n in range(1000)))
    client.force_login(scene.milo)
    body = client.get(_job_url(job, "job_live")).content.decode()
    assert "line 999" in body and "line 700\n" in body
    assert "line 699\n" not in body


def test_a_rejected_job_shows_each_workers_pre_flight_checks(client, scene):
    job = make_job(
        scene.vm,
        scene.milo,
        "rejected",
        reason="The pre-flight failed on worker 0 (tpu5-w0): python: no jax",
        preflight={"0": [["chips", "ok", "4 /dev/accel*"], ["python", "fail", "no jax in /x"]]},
    )
    client.force_login(scene.milo)
    body = client.get(_job_url(job)).content.decode()
    assert "The pre-flight failed on worker 0 (tpu5-w0): python: no jax" in body
    checks = body[body.index('id="job-preflight"') :]
    assert checks.startswith('id="job-preflight" open>')
    assert "Worker 0 (tpu5-w0)" in checks and "no jax in /x" in checks and "4 /dev/accel*" in checks


def test_a_blocked_job_says_its_place_in_the_queue(client, scene):
    make_job(scene.vm, scene.ann, "queued", queued_at=timezone.now() - timezone.timedelta(hours=1))
    job = make_job(scene.vm, scene.milo, "blocked", reason="The TPU is in use outside the portal")
    client.force_login(scene.milo)
    body = client.get(_job_url(job)).content.decode()
    assert "number 2 in tpu5's queue" in body
    assert "It has not reached the workers yet" in body


def test_others_who_share_the_vm_get_a_404_for_a_jobs_page_and_its_log(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.ann)
    for name in ("job_detail", "job_live"):
        assert client.get(_job_url(job, name)).status_code == 404
    log = reverse("job_log", args=[scene.lab.slug, scene.vm.pk, job.pk, 0])
    assert client.get(log).status_code == 404
    assert client.post(_job_url(job, "job_cancel")).status_code == 404
    assert Job.objects.get(pk=job.pk).state == "running"


def test_the_labs_admins_see_any_job_of_the_lab(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.admin)
    body = client.get(_job_url(job)).content.decode()
    assert "milo@vision.example" in body and "hello from worker 0" in body
    assert "Run again" not in body and "Cancel</button>" in body


def test_a_log_the_worker_cannot_give_is_a_clear_error_page(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    client.force_login(scene.milo)
    response = client.get(reverse("job_log", args=[scene.lab.slug, scene.vm.pk, job.pk, 0]))
    assert response.status_code == 502
    body = response.content.decode()
    assert "cannot be downloaded now" in body
    assert "worker 0 (tpu5-w0) cannot give the log" in body
    assert _job_url(job) in body


def test_a_worker_the_job_never_reached_has_no_log(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    client.force_login(scene.milo)
    url = reverse("job_log", args=[scene.lab.slug, scene.vm.pk, job.pk, 3])
    assert client.get(url).status_code == 404


# --- cancel and run again -------------------------------------------------------------


def test_the_owner_cancels_a_waiting_job_at_once(client, scene):
    job = make_job(scene.vm, scene.milo, "queued")
    client.force_login(scene.milo)
    response = client.post(_job_url(job, "job_cancel"), follow=True)
    job.refresh_from_db()
    assert job.state == "cancelled" and job.cancelled_by == scene.milo
    assert f"Job {job.pk} is cancelled." in response.content.decode()


def test_an_admin_cancels_someone_elses_running_job(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.admin)
    response = client.post(_job_url(job, "job_cancel"), follow=True)
    job.refresh_from_db()
    assert job.state == "cancelling" and job.cancelled_by == scene.admin
    assert "Stopping job" in response.content.decode()


def test_cancelling_an_ended_job_changes_nothing(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    client.force_login(scene.milo)
    response = client.post(_job_url(job, "job_cancel"), follow=True)
    assert "there is nothing to cancel" in response.content.decode()
    job.refresh_from_db()
    assert job.state == "succeeded" and job.cancelled_by is None


def test_cancel_and_run_again_are_posts(client, scene):
    job = make_job(scene.vm, scene.milo, "queued")
    client.force_login(scene.milo)
    assert client.get(_job_url(job, "job_cancel")).status_code == 405
    assert client.get(_job_url(job, "job_rerun")).status_code == 405
    job.refresh_from_db()
    assert job.state == "queued"


def test_the_owner_runs_an_ended_job_again_at_the_end_of_the_queue(client, scene):
    job = make_job(scene.vm, scene.milo, "failed", env=[["SEED", "1"]], time_limit_minutes=5)
    client.force_login(scene.milo)
    response = client.post(_job_url(job, "job_rerun"))
    new = Job.objects.exclude(pk=job.pk).get()
    assert response.status_code == 302 and response["Location"] == _job_url(new)
    assert new.rerun_of == job and new.state == "queued" and new.host_id != job.host_id
    assert (new.args, new.env, new.time_limit_minutes) == (job.args, job.env, 5)


def test_an_admin_cannot_run_someone_elses_job_again(client, scene):
    job = make_job(scene.vm, scene.milo, "failed")
    client.force_login(scene.admin)
    assert client.post(_job_url(job, "job_rerun")).status_code == 403
    assert Job.objects.count() == 1


def test_running_again_a_job_that_has_not_ended_or_without_access_says_why(client, scene):
    running = make_job(scene.vm, scene.milo, "running")
    client.force_login(scene.milo)
    response = client.post(_job_url(running, "job_rerun"), follow=True)
    assert "The job has not ended yet." in response.content.decode()
    ended = make_job(scene.vm, scene.milo, "succeeded")
    Grant.objects.filter(user=scene.milo).update(state="revoked")
    scene.milo.grants.update(state="revoking")  # still sees the VM, no longer runs jobs
    response = client.post(_job_url(ended, "job_rerun"), follow=True)
    assert "You need active access to tpu5" in response.content.decode()
    assert Job.objects.count() == 2


# --- tenancy --------------------------------------------------------------------------


def test_another_labs_vm_or_job_is_a_404_through_every_job_page_and_endpoint(client, cast, scene):
    from accounts.services import create_token

    other_vm = make_vm(cast.other_lab, "tpu5")
    theirs = make_job(other_vm, cast.outsider, "running")
    mine = make_job(scene.vm, scene.milo, "running")
    second = make_vm(scene.lab, "tpu6")
    Grant.objects.create(user=scene.milo, vm=second, state="active")
    vision, other = scene.lab.slug, cast.other_lab.slug
    # (lab, vm, job): the other lab's VM and job through this lab, the other lab's job
    # under this lab's VM, the other lab itself, and a job under another VM of the lab.
    jobs = [
        (vision, other_vm.pk, theirs.pk),
        (vision, scene.vm.pk, theirs.pk),
        (other, other_vm.pk, theirs.pk),
        (vision, second.pk, mine.pk),
    ]
    vms = [(vision, other_vm.pk), (other, other_vm.pk)]
    requests = []
    for lab, vm, job in jobs:
        page = f"/labs/{lab}/vms/{vm}/jobs/{job}"
        api = f"/api/v1/labs/{lab}/vms/{vm}/jobs/{job}"
        requests += [
            ("get", f"{page}/"),
            ("get", f"{page}/live/"),
            ("get", f"{page}/workers/0/log"),
            ("post", f"{page}/cancel/"),
            ("post", f"{page}/rerun/"),
            ("get", api),
            ("get", f"{api}/workers/0/log"),
            ("post", f"{api}/cancel"),
            ("post", f"{api}/rerun"),
        ]
    for lab, vm in vms:
        requests += [
            ("get", f"/labs/{lab}/vms/{vm}/jobs/"),
            ("get", f"/labs/{lab}/vms/{vm}/jobs/new/"),
            ("post", f"/labs/{lab}/vms/{vm}/jobs/new/"),
            ("get", f"/api/v1/labs/{lab}/vms/{vm}/jobs"),
            ("post", f"/api/v1/labs/{lab}/vms/{vm}/jobs"),
        ]
    requests += [
        ("get", f"/labs/{other}/usage/"),
        ("get", f"/labs/{other}/usage/csv/"),
        ("get", f"/api/v1/labs/{other}/usage"),
        ("get", f"/api/v1/labs/{other}/usage/people"),
        ("get", f"/api/v1/labs/{other}/usage/vms"),
        ("get", f"/api/v1/labs/{other}/usage/now"),
    ]
    for user in (scene.admin, scene.milo):
        client.force_login(user)
        token = {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 't')[1]}"}
        for method, url in requests:
            if url.startswith("/api/"):
                body = {"args": ["true"]}
                response = getattr(client, method)(url, body, "application/json", **token)
            else:
                response = getattr(client, method)(url, {"command": "true"})
            assert response.status_code == 404, (user, method, url, response.status_code)
    theirs.refresh_from_db()
    mine.refresh_from_db()
    assert theirs.state == mine.state == "running" and Job.objects.count() == 2


def test_the_email_at_the_end_links_to_the_jobs_page(
    client, scene, settings, django_capture_on_commit_callbacks
):
    from django.core import mail

    from tpus.services import emails

    job = make_job(scene.vm, scene.milo, "failed", notify=True, reason="Worker 0 exit 1.")
    with django_capture_on_commit_callbacks(execute=True):
        emails.send_job_email(job.pk)
    [message] = mail.outbox
    assert message.to == ["milo@vision.example"]
    assert f"{settings.SITE_URL}{_job_url(job)}" in message.body
    client.force_login(scene.milo)
    assert client.get(_job_url(job)).status_code == 200


@pytest.mark.parametrize("how", ["submit", "rerun"])
def test_a_job_that_ended_before_its_page_showed_never_reads_as_queued(client, scene, how):
    client.force_login(scene.milo)
    if how == "submit":
        response = client.post(_submit_url(scene), {"command": "python3 train.py"})
    else:
        response = client.post(_job_url(make_job(scene.vm, scene.milo, "failed"), "job_rerun"))
    job = Job.objects.order_by("pk").last()
    assert response.status_code == 302 and response["Location"] == _job_url(job)
    # A short job: it ran and ended before the browser followed the redirect.
    Job.objects.filter(pk=job.pk).update(
        state="succeeded", started_at=timezone.now(), ended_at=timezone.now()
    )

    body = client.get(response["Location"]).content.decode()

    assert "queued on" not in body and "is queued" not in body
    assert f"Job {job.pk} submitted to tpu5" in body
    assert '<span class="badge job-succeeded">Succeeded</span>' in body

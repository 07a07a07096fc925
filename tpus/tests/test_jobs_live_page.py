"""A job's page in a real browser: the log and state follow the job without a page
load, the polling stops once the job has ended, and Cancel asks first. The job pass
is not this test's subject: the job's rows are changed directly, as a pass would."""

from __future__ import annotations

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from accounts.models import UnixAccount
from tpus.models import Grant, Job, JobWorker
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PASSWORD = "a long passphrase 42"


@pytest.fixture
def signed_in(page, make_lab, make_user, add_member):
    lab = make_lab("Vision Lab", slug="vision")
    milo = make_user("milo@uni.example", password=PASSWORD)
    add_member(lab, milo)
    UnixAccount.objects.create(user=milo, username="milo", uid=30_002)
    vm = make_vm(lab, "tpu5")
    Grant.objects.create(user=milo, vm=vm, state="active")
    page.goto("/accounts/login/")
    page.fill("input[name=login]", "milo@uni.example")
    page.fill("input[name=password]", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    return page, vm, milo


def test_the_log_follows_the_job_without_a_page_load_and_stops_when_it_ends(signed_in):
    page, vm, milo = signed_in
    job = make_job(vm, milo, "running")
    page.goto(f"/labs/vision/vms/{vm.pk}/jobs/{job.pk}/")
    expect(page.locator("#job-log-0")).to_have_text("hello from worker 0\n")
    page.evaluate("window.stillTheSamePage = true")

    JobWorker.objects.filter(job=job).update(log_tail="hello from worker 0\nstep 1 loss 0.5\n")
    expect(page.locator("#job-log-0")).to_contain_text("step 1 loss 0.5", timeout=5_000)

    now = timezone.now()
    JobWorker.objects.filter(job=job).update(state="ended", exit_status=0, ended_at=now)
    Job.objects.filter(pk=job.pk).update(state="succeeded", ended_at=now)
    expect(page.locator("#job-state .badge")).to_have_text("Succeeded", timeout=5_000)
    expect(page.get_by_role("button", name="Run again")).to_be_visible()
    expect(page.get_by_role("button", name="Cancel")).to_have_count(0)
    assert page.evaluate("window.stillTheSamePage") is True

    polls = []
    page.on(
        "request", lambda request: polls.append(request.url) if "/live/" in request.url else None
    )
    page.wait_for_timeout(4_500)
    assert polls == []


def test_cancel_asks_first_and_a_no_changes_nothing(signed_in):
    page, vm, milo = signed_in
    job = make_job(vm, milo, "queued")
    page.goto(f"/labs/vision/vms/{vm.pk}/jobs/{job.pk}/")
    page.once("dialog", lambda dialog: dialog.dismiss())
    page.get_by_role("button", name="Cancel").click()
    page.wait_for_timeout(500)
    job.refresh_from_db()
    assert job.state == "queued"
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator(".messages")).to_contain_text(f"Job {job.pk} is cancelled.")
    job.refresh_from_db()
    assert job.state == "cancelled"


def test_the_job_pages_fit_a_phone_and_pass_axe(page, live_server, make_lab, make_user, add_member):
    from tests.test_journey_a11y import _check_pages, _sign_in

    lab = make_lab("Vision Lab", slug="vision")
    boss = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, boss, role="admin")
    milo = make_user("milo.sandoval-kowalczyk@university.example", password=PASSWORD)
    add_member(lab, milo)
    UnixAccount.objects.create(user=milo, username="milo", uid=30_002)
    vm = make_vm(lab, "tpu5-very-long-pod-name-for-layout", workers=4)
    vm.outside_holders = [
        {"worker": 2, "device": "/dev/accel0", "pid": "4242", "user": "root",
         "command": "/usr/bin/python3 /home/someone/experiments/very_long_script_name.py --flag"}
    ]  # fmt: skip
    vm.usage_checked_at = timezone.now()
    vm.save()
    Grant.objects.create(user=milo, vm=vm, state="active")
    long_args = ["python3", "/home/milo/src/train_a_very_large_model.py", "--config=" + "x" * 120]
    running = make_job(vm, milo, "running", args=long_args, env=[["XLA_FLAGS", "--x" * 60]])
    running.parts.update(
        log_tail="".join(f"step {n} loss {1 / (n + 1):.6f} " * 8 + "\n" for n in range(50))
    )
    blocked = make_job(
        vm, milo, "blocked", args=long_args,
        reason="The TPU is in use outside the portal: worker 2 (tpu5-very-long-pod-name-for-"
        "layout-w2): chip_holder: /dev/accel0 pid=4242 user=root command=/usr/bin/python3 x.py",
        preflight={"2": [["chip_holder", "fail", "/dev/accel0 pid=4242 user=root command=x"]]},
    )  # fmt: skip
    base = f"/labs/vision/vms/{vm.pk}"
    urls = {
        "vm": f"{base}/",
        "job-running": f"{base}/jobs/{running.pk}/",
        "job-blocked": f"{base}/jobs/{blocked.pk}/",
        "job-new": f"{base}/jobs/new/",
        "usage": "/labs/vision/usage/",
    }
    _sign_in(page, milo.email)
    problems = _check_pages(page, "member-jobs", urls)
    page.context.clear_cookies()
    _sign_in(page, boss.email)
    problems += _check_pages(page, "admin-jobs", {k: v for k, v in urls.items() if k != "job-new"})
    assert not problems, "\n".join(problems)

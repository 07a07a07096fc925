"""What a job shows, and to whom: people who share a VM see the program of another
person's job (``python3 train.py``), never its arguments or environment, on every page
and endpoint that lists it; its owner and the lab's admins see all of it. A refused job
shows its checks as rows; a worker on which nothing started offers no log; a cancel
during the checks says what will happen."""

from __future__ import annotations

import html

import pytest
from django.urls import reverse

from accounts.services import create_token
from tpus.models import Grant
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene

SECRET_ARGS = ["python3", "-u", "train.py", "--wandb-key", "s3cr3t"]


def _auth(user) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}


def _page(client, user, name, *args) -> str:
    client.force_login(user)
    response = client.get(reverse(name, args=args))
    assert response.status_code == 200
    return html.unescape(response.content.decode())


def _job_url(job, name="job_detail"):
    return reverse(name, args=[job.vm.lab.slug, job.vm_id, job.pk])


# --- the program, not the arguments -----------------------------------------------------


def test_a_job_is_shown_as_its_program_without_arguments():
    from tpus.models import Job

    cases = {
        ("python3", "train.py", "--lr", "0.1"): "python3 train.py …",
        ("python3", "-u", "-m", "lab.train", "--x"): "python3 -m lab.train …",
        ("/home/milo/venv/bin/python", "t.py"): "/home/milo/venv/bin/python t.py",
        ("bash", "-c", "echo s3cr3t"): "bash …",
        ("./run.sh",): "./run.sh",
    }
    for argv, shown in cases.items():
        assert Job(args=list(argv)).program_text == shown, argv
    script = Job(script="/home/milo/train.py", args=["--key", "s3cr3t"])
    assert script.program_text == "python3 /home/milo/train.py …"


def test_a_command_keeps_its_apostrophes_readably():
    from tpus.models import Job

    assert Job(args=["echo", "milo's run"]).command_text == 'echo "milo\'s run"'
    assert Job(args=["sh", "-c", "echo $HOME's"]).command_text == "sh -c 'echo $HOME'\"'\"'s'"


def test_the_vm_page_shows_others_the_program_of_a_running_and_a_waiting_job(client, scene):
    make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS, env=[["WANDB_KEY", "k3y"]])
    make_job(scene.vm, scene.ann, "queued", args=["python3", "next.py", "--token", "t0k"])
    body = _page(client, scene.milo, "vm_detail", scene.lab.slug, scene.vm.pk)
    now = body[body.index('id="tpu-now"') :]
    assert "python3 train.py …" in now
    queue = body[body.index('id="job-queue"') :]
    assert "python3 next.py …" in queue
    for secret in ("s3cr3t", "t0k", "k3y", "--wandb-key"):
        assert secret not in body, secret
    # The live part (htmx) says the same.
    live = _page(client, scene.milo, "vm_jobs", scene.lab.slug, scene.vm.pk)
    assert "python3 train.py …" in live and "s3cr3t" not in live and "t0k" not in live


def test_the_owner_and_the_labs_admins_see_the_whole_command_on_the_vm_page(client, scene):
    make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS)
    make_job(scene.vm, scene.ann, "queued", args=["python3", "next.py", "--token", "t0k"])
    for user in (scene.ann, scene.admin):
        body = _page(client, user, "vm_jobs", scene.lab.slug, scene.vm.pk)
        assert "python3 -u train.py --wandb-key s3cr3t" in body
        assert "python3 next.py --token t0k" in body


def test_the_usage_page_shows_members_the_program_and_admins_the_command(client, scene):
    make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS)
    body = _page(client, scene.milo, "lab_usage", scene.lab.slug)
    assert "python3 train.py …" in body and "s3cr3t" not in body
    body = _page(client, scene.admin, "lab_usage", scene.lab.slug)
    assert "python3 -u train.py --wandb-key s3cr3t" in body


def test_the_api_lists_others_jobs_by_program_and_says_the_command_is_not_complete(client, scene):
    theirs = make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS)
    mine = make_job(scene.vm, scene.milo, "queued", args=["python3", "mine.py", "--seed", "1"])
    url = f"/api/v1/labs/{scene.lab.slug}/vms/{scene.vm.pk}/jobs"
    items = {j["id"]: j for j in client.get(url, **_auth(scene.milo)).json()["items"]}
    assert (items[theirs.pk]["command"], items[theirs.pk]["command_complete"]) == (
        "python3 train.py",
        False,
    )
    assert items[mine.pk]["command"] == "python3 mine.py --seed 1"
    assert items[mine.pk]["command_complete"] is True
    for user in (scene.admin, scene.ann):
        items = {j["id"]: j for j in client.get(url, **_auth(user)).json()["items"]}
        assert items[theirs.pk]["command"] == "python3 -u train.py --wandb-key s3cr3t"
        assert items[theirs.pk]["command_complete"] is True
    # A job whose program is all of it hides nothing.
    plain = make_job(scene.vm, scene.ann, "queued", args=["nvidia-smi"])
    items = {j["id"]: j for j in client.get(url, **_auth(scene.milo)).json()["items"]}
    assert (items[plain.pk]["command"], items[plain.pk]["command_complete"]) == (
        "nvidia-smi",
        True,
    )


def test_the_usage_api_shows_members_the_program_of_what_runs_now(client, scene):
    make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS)
    url = f"/api/v1/labs/{scene.lab.slug}/usage"
    text = client.get(url, **_auth(scene.milo)).content.decode()
    assert "python3 train.py" in text and "s3cr3t" not in text
    text = client.get(url, **_auth(scene.admin)).content.decode()
    assert "python3 -u train.py --wandb-key s3cr3t" in text


def test_others_still_cannot_open_the_jobs_own_page_or_object(client, scene):
    job = make_job(scene.vm, scene.ann, "running", args=SECRET_ARGS)
    client.force_login(scene.milo)
    assert client.get(_job_url(job)).status_code == 404
    url = f"/api/v1/labs/{scene.lab.slug}/vms/{scene.vm.pk}/jobs/{job.pk}"
    assert client.get(url, **_auth(scene.milo)).status_code == 404
    assert client.get(url, **_auth(scene.admin)).json()["command_complete"] is True


# --- a refused job ---------------------------------------------------------------------


@pytest.fixture
def rejected(scene):
    vm = make_vm(scene.lab, "pod5", workers=2)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    missing = "/home/milo/train.py does not exist or milo cannot reach it"
    job = make_job(
        vm,
        scene.milo,
        "rejected",
        script="/home/milo/train.py",
        args=[],
        reason=f"The pre-flight failed on every worker (2): script: {missing}. "
        "Copy your code to every worker, or keep it on a data disk.",
        preflight={
            str(i): [["chips", "ok", "4 of 4 at /dev/accel*"], ["script", "fail", missing]]
            for i in range(2)
        },
    )
    job.parts.update(state="not_started", pid=None, started_at=None, log_tail="", log_size=0)
    return job


def test_a_rejected_jobs_api_object_has_its_failing_checks_as_rows_and_no_log_to_download(
    client, scene, rejected
):
    url = f"/api/v1/labs/{scene.lab.slug}/vms/{rejected.vm_id}/jobs/{rejected.pk}"
    body = client.get(url, **_auth(scene.milo)).json()
    assert body["state"] == "rejected"
    fails = [r for r in body["preflight"] if r["status"] == "fail"]
    assert fails == [
        {"worker": i, "check": "script", "status": "fail",
         "detail": "/home/milo/train.py does not exist or milo cannot reach it"}
        for i in range(2)
    ]  # fmt: skip
    assert [p["log_url"] for p in body["parts"]] == [None, None]
    response = client.get(f"{url}/workers/0/log", **_auth(scene.milo))
    assert response.status_code == 404 and "no log" in response.json()["detail"]


def test_a_rejected_jobs_page_says_the_refusal_once_with_its_table_and_no_log_link(
    client, scene, rejected
):
    body = _page(client, scene.milo, "job_detail", scene.lab.slug, rejected.vm_id, rejected.pk)
    # Once in the reason, once in the table (one row for both workers).
    assert body.count("does not exist or milo cannot reach it") == 2
    table = body[body.index('id="job-preflight"') :]
    row = table[: table.index("does not exist")]
    assert row.endswith("<td>Every worker (2)</td><td><code>/home/milo/train.py ")
    assert table.index(">fail<") < table.index(">ok<")  # failures first
    reason = body[body.index('id="job-reason"') :]
    assert reason.startswith('id="job-reason">The pre-flight failed on every worker (2)')
    assert "Copy your code to every worker, or keep it on a data disk." in reason
    assert 'id="job-preflight" open>' in body
    assert "Download full log" not in body and "tail -f" not in body
    assert "Nothing started on this worker, so it has no log." in body
    client.force_login(scene.milo)
    log = reverse("job_log", args=[scene.lab.slug, rejected.vm_id, rejected.pk, 0])
    assert client.get(log).status_code == 404


def test_a_started_workers_log_still_downloads_beside_one_that_never_started(client, scene):
    vm = make_vm(scene.lab, "pod6", workers=2)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    job = make_job(vm, scene.milo, "failed")
    job.parts.filter(index=1).update(state="not_started", pid=None, started_at=None)
    body = _page(client, scene.milo, "job_detail", scene.lab.slug, vm.pk, job.pk)
    assert body.count("Download full log") == 1
    assert reverse("job_log", args=[scene.lab.slug, vm.pk, job.pk, 0]) in body


# --- a cancel while the checks run ------------------------------------------------------


def test_a_cancel_during_the_checks_answers_cancelling_and_says_it_will_not_start(client, scene):
    job = make_job(scene.vm, scene.milo, "validating")
    url = f"/api/v1/labs/{scene.lab.slug}/vms/{scene.vm.pk}/jobs/{job.pk}/cancel"
    response = client.post(url, {}, content_type="application/json", **_auth(scene.milo))
    assert response.status_code == 200 and response.json()["state"] == "cancelling"
    again = make_job(scene.vm, scene.ann, "queued")
    job.delete()
    from tpus.models import Job

    Job.objects.filter(pk=again.pk).update(state="validating")
    client.force_login(scene.ann)
    response = client.post(_job_url(again, "job_cancel"), follow=True)
    body = html.unescape(response.content.decode())
    assert f"Cancelling job {again.pk}: it will not start" in body
    assert "Cancelling</span>" in body


def test_the_pre_flight_table_names_the_workers_of_a_row_that_is_not_on_all():
    from tpus.views.jobs import preflight_rows

    aliases = {i: f"pod5-w{i}" for i in range(3)}
    rows = preflight_rows(
        {
            "0": [["chips", "ok", "4 of 4"], ["disk", "ok", "900 MB free"]],
            "1": [["chips", "ok", "4 of 4"], ["disk", "ok", "800 MB free"]],
            "2": [["chips", "ok", "4 of 4"], ["disk", "fail", "8 MB free, below 10 MB"]],
        },
        aliases,
    )
    assert [(r["name"], r["status"], r["where"]) for r in rows] == [
        ("disk", "fail", "Worker 2 (pod5-w2)"),
        ("chips", "ok", "Every worker (3)"),
        ("disk", "ok", "Worker 0 (pod5-w0)"),
        ("disk", "ok", "Worker 1 (pod5-w1)"),
    ]

"""The jobs API: queue a job, list a VM's jobs a page at a time, follow one, cancel,
run again, a worker's whole log. Jobs are rows made directly; a submitted job's pass
waits for a commit these tests never reach."""

from __future__ import annotations

import pytest
from django.utils import timezone

from accounts.services import create_token
from tpus.models import Grant, Job
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


def _auth(user) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}


def _jobs(scene, vm=None) -> str:
    return f"/api/v1/labs/{scene.lab.slug}/vms/{(vm or scene.vm).pk}/jobs"


def _post(client, url, user, body=None):
    return client.post(url, body or {}, content_type="application/json", **_auth(user))


def test_a_command_is_queued_with_a_token(client, scene, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = _post(
            client,
            _jobs(scene),
            scene.milo,
            {
                "args": ["python3", "train.py", "--name", "my run"],
                "python": "~/venv",
                "cwd": "work",
                "env": {"SEED": "1", "XLA_FLAGS": "--xla_dump_to=/tmp/x"},
                "time_limit_minutes": 30,
                "notify": True,
            },
        )
    assert response.status_code == 201, response.content
    body = response.json()
    job = Job.objects.get()
    assert body["id"] == job.pk and body["state"] == "queued" and body["position"] == 1
    assert body["command"] == "python3 train.py --name 'my run'"
    assert body["python"] == "/home/milo/venv" and body["cwd"] == "/home/milo/work"
    assert body["env"] == [["SEED", "1"], ["XLA_FLAGS", "--xla_dump_to=/tmp/x"]]
    assert body["use_tcmalloc"] is True and body["notify"] is True
    assert body["parts"] == [] and body["username"] == "milo"
    assert body["url"].endswith(f"/labs/vision/vms/{scene.vm.pk}/jobs/{job.pk}/")
    assert len(callbacks) == 1


@pytest.mark.parametrize(
    "env",
    [[["A", "1"], ["B", "x=y"]], ["A=1", "B=x=y"]],
    ids=["pairs", "lines"],
)
def test_a_script_with_arguments_and_the_environment_as_a_list(client, scene, env):
    response = _post(
        client,
        _jobs(scene),
        scene.milo,
        {"script": "train.py", "args": ["--lr", "0.1"], "env": env, "use_tcmalloc": False},
    )
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.argv == ["python3", "/home/milo/train.py", "--lr", "0.1"]
    assert job.env == [["A", "1"], ["B", "x=y"]] and not job.use_tcmalloc


@pytest.mark.parametrize(
    "payload, field, fragment",
    [
        ({}, "args", "Give the command to run, or a script."),
        ({"args": ["A=1", "python3"]}, "args", "not NAME=value"),
        ({"script": "../x.py"}, "script", "may not contain '..'"),
        ({"args": ["true"], "cwd": "/etc"}, "cwd", "must be inside your home"),
        ({"args": ["true"], "env": {"PATH": "/x"}}, "env", "is set by the portal"),
        ({"args": ["true"], "env": {"A": "x\u0001"}}, "env", "control characters"),
        ({"args": ["true"], "time_limit_minutes": 0}, "time_limit_minutes", "1 to 10080"),
        ({"args": ["a\nb"]}, "args", "control characters"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_stores_nothing(
    client, scene, payload, field, fragment
):
    response = _post(client, _jobs(scene), scene.milo, payload)
    assert response.status_code == 400, response.content
    body = response.json()
    assert fragment in body["detail"]
    assert any(fragment in message for message in body["errors"][field]), body
    assert not Job.objects.exists()


def _validate(scene) -> str:
    return _jobs(scene) + "/validate"


def test_a_job_is_checked_as_queueing_it_would_and_nothing_is_stored(client, scene):
    from portal.audit import AuditAction
    from tpus.models.audit import AuditEvent

    good = _post(client, _validate(scene), scene.milo, {"args": ["python3", "t.py"], "cwd": "w"})
    assert good.status_code == 200, good.content
    assert good.json() == {"ok": True, "detail": "tpu5 would queue this job."}
    refused = _post(client, _validate(scene), scene.milo,
                    {"args": ["true"], "env": ["TPU_VISIBLE_CHIPS=0"]})  # fmt: skip
    assert refused.status_code == 400
    assert "TPU_VISIBLE_CHIPS" in refused.json()["errors"]["env"][0]
    assert (
        not Job.objects.exists()
        and not AuditEvent.objects.filter(action=AuditAction.JOB_SUBMITTED).exists()
    )
    Grant.objects.filter(user=scene.milo).update(state="pending")
    denied = _post(client, _validate(scene), scene.milo, {"args": ["true"]})
    assert denied.status_code == 403
    assert "You need active access to tpu5" in denied.json()["detail"]
    assert not Job.objects.exists()


def test_an_env_line_without_equals_is_a_400(client, scene):
    response = _post(client, _jobs(scene), scene.milo, {"args": ["true"], "env": ["JUSTANAME"]})
    assert response.status_code == 400
    assert "not NAME=value" in response.json()["detail"]
    assert not Job.objects.exists()


def test_without_active_access_a_job_is_a_403_with_the_reason(client, scene):
    Grant.objects.filter(user=scene.milo).update(state="pending")
    response = _post(client, _jobs(scene), scene.milo, {"args": ["true"]})
    assert response.status_code == 403
    assert "You need active access to tpu5" in response.json()["detail"]
    assert not Job.objects.exists()


def test_a_full_queue_is_a_400(client, scene):
    scene.lab.max_queued_jobs = 1
    scene.lab.save()
    make_job(scene.vm, scene.milo, "queued")
    response = _post(client, _jobs(scene), scene.milo, {"args": ["true"]})
    assert response.status_code == 400
    assert "this lab allows 1" in response.json()["detail"]
    assert Job.objects.count() == 1


def test_the_list_pages_by_keyset_and_filters(client, scene):
    made = [make_job(scene.vm, scene.milo, "succeeded") for _ in range(3)]
    made.append(make_job(scene.vm, scene.ann, "queued"))
    headers = _auth(scene.admin)
    page = client.get(_jobs(scene) + "?limit=2", **headers).json()
    assert [j["id"] for j in page["items"]] == [made[0].pk, made[1].pk]
    assert page["total"] == 4
    rest = client.get(page["next"], **headers).json()
    assert [j["id"] for j in rest["items"]] == [made[2].pk, made[3].pk] and rest["next"] is None
    queued = client.get(_jobs(scene) + "?state=queued", **headers).json()
    assert [j["id"] for j in queued["items"]] == [made[3].pk]
    anns = client.get(_jobs(scene) + "?user=ann", **headers).json()
    assert [j["id"] for j in anns["items"]] == [made[3].pk]
    Job.objects.filter(pk=made[1].pk).update(changed_at=timezone.now() + timezone.timedelta(1))
    since = (timezone.now() + timezone.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    changed = client.get(_jobs(scene) + f"?updated_since={since}", **headers).json()
    assert [j["id"] for j in changed["items"]] == [made[1].pk]
    for query, fragment in (
        ("?state=done", "state must be one of"),
        ("?user=nobody", "matches no email"),
        ("?status=queued", "Unknown query parameter"),
    ):
        response = client.get(_jobs(scene) + query, **headers)
        assert response.status_code == 400 and fragment in response.json()["detail"]


def test_a_member_lists_their_own_jobs_and_what_waits_or_runs_but_not_others_past(client, scene):
    mine = make_job(scene.vm, scene.milo, "failed")
    running = make_job(scene.vm, scene.ann, "running")
    waiting = make_job(scene.vm, scene.ann, "queued")
    make_job(scene.vm, scene.ann, "succeeded")
    body = client.get(_jobs(scene), **_auth(scene.milo)).json()
    assert sorted(j["id"] for j in body["items"]) == [mine.pk, running.pk, waiting.pk]
    assert "env" not in body["items"][0] and "parts" not in body["items"][0]


def test_one_job_has_its_workers_parts_with_their_log_tails(client, scene):
    vm = make_vm(scene.lab, "pod1", workers=2)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    job = make_job(vm, scene.milo, "running", env=[["SEED", "7"]])
    for headers in (_auth(scene.milo), _auth(scene.admin)):
        body = client.get(f"{_jobs(scene, vm)}/{job.pk}", **headers).json()
        assert body["env"] == [["SEED", "7"]]
        assert [p["alias"] for p in body["parts"]] == ["pod1-w0", "pod1-w1"]
        part = body["parts"][1]
        assert part["state"] == "running" and part["log_tail"] == "hello from worker 1\n"
        assert part["log_url"].endswith(f"/jobs/{job.pk}/workers/1/log")
    assert client.get(f"{_jobs(scene, vm)}/{job.pk}", **_auth(scene.ann)).status_code == 404


def test_cancel_is_for_the_owner_and_the_admins(client, scene):
    job = make_job(scene.vm, scene.milo, "running")
    url = f"{_jobs(scene)}/{job.pk}/cancel"
    assert _post(client, url, scene.ann).status_code == 404
    response = _post(client, url, scene.admin)
    assert response.status_code == 200 and response.json()["state"] == "cancelling"
    waiting = make_job(scene.vm, scene.milo, "queued")
    response = _post(client, f"{_jobs(scene)}/{waiting.pk}/cancel", scene.milo)
    assert response.json()["state"] == "cancelled"
    again = _post(client, f"{_jobs(scene)}/{waiting.pk}/cancel", scene.milo)
    assert again.status_code == 409 and "nothing to cancel" in again.json()["detail"]


def test_run_again_is_for_the_owner_of_an_ended_job(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    url = f"{_jobs(scene)}/{job.pk}/rerun"
    assert _post(client, url, scene.ann).status_code == 404
    assert _post(client, url, scene.admin).status_code == 403
    response = _post(client, url, scene.milo)
    assert response.status_code == 201
    assert response.json()["rerun_of"] == job.pk and response.json()["state"] == "queued"
    running = make_job(scene.vm, scene.milo, "running")
    response = _post(client, f"{_jobs(scene)}/{running.pk}/rerun", scene.milo)
    assert response.status_code == 409
    assert Job.objects.filter(rerun_of__isnull=False).count() == 1


def test_a_log_the_worker_cannot_give_is_a_502_and_a_missing_worker_a_404(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    response = client.get(f"{_jobs(scene)}/{job.pk}/workers/0/log", **_auth(scene.milo))
    assert response.status_code == 502
    assert "worker 0 (tpu5-w0) cannot give the log" in response.json()["detail"]
    response = client.get(f"{_jobs(scene)}/{job.pk}/workers/5/log", **_auth(scene.milo))
    assert response.status_code == 404


def test_the_job_endpoints_are_documented(client, db):
    paths = client.get("/api/v1/openapi.json").json()["paths"]
    base = "/api/v1/labs/{slug}/vms/{vm_id}/jobs"
    for path in (
        base,
        base + "/{job_id}",
        base + "/{job_id}/cancel",
        base + "/{job_id}/rerun",
        base + "/{job_id}/workers/{index}/log",
        "/api/v1/labs/{slug}/usage",
        "/api/v1/labs/{slug}/usage/people",
        "/api/v1/labs/{slug}/usage/vms",
        "/api/v1/labs/{slug}/usage/now",
        "/api/v1/me/jobs/{job_id}",
    ):
        assert path in paths, path


def test_my_job_by_its_id_alone_is_the_object_its_vms_path_answers(client, scene):
    job = make_job(scene.vm, scene.milo, "running", env=[["SEED", "7"]])
    headers = _auth(scene.milo)
    mine = client.get(f"/api/v1/me/jobs/{job.pk}", **headers)
    assert mine.status_code == 200, mine.content
    by_vm = client.get(f"{_jobs(scene)}/{job.pk}", **headers).json()
    assert mine.json() == by_vm
    assert (by_vm["lab"], by_vm["vm_id"]) == ("vision", scene.vm.pk)


def test_another_persons_job_is_a_404_at_my_jobs_even_for_the_labs_admin(client, scene):
    job = make_job(scene.vm, scene.ann, "running")
    missing = client.get("/api/v1/me/jobs/999999", **_auth(scene.ann))
    assert missing.status_code == 404
    for person in (scene.milo, scene.admin):
        response = client.get(f"/api/v1/me/jobs/{job.pk}", **_auth(person))
        assert response.status_code == 404 and response.json() == missing.json()


def test_a_job_in_another_lab_or_a_lab_i_left_is_a_404_at_my_jobs(client, scene, cast):
    theirs = make_vm(cast.other_lab, "tpu9")
    Grant.objects.create(user=cast.outsider, vm=theirs, state="active")
    other = make_job(theirs, cast.outsider, "succeeded")
    assert client.get(f"/api/v1/me/jobs/{other.pk}", **_auth(scene.milo)).status_code == 404
    assert client.get(f"/api/v1/me/jobs/{other.pk}", **_auth(cast.outsider)).status_code == 200
    mine = make_job(scene.vm, scene.milo, "succeeded")
    cast.member_membership.state = "removed"
    cast.member_membership.save(update_fields=["state"])
    assert client.get(f"/api/v1/me/jobs/{mine.pk}", **_auth(scene.milo)).status_code == 404


@pytest.mark.parametrize("workers", [2, 16])
def test_my_pod_job_is_read_in_the_same_five_queries_whatever_its_workers(
    client, scene, django_assert_num_queries, workers
):
    vm = make_vm(scene.lab, "pod1", workers=workers)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    rows = [["chips", "ok", "4 of 4 at /dev/accel*"], ["python", "ok", "jax 0.4.35"]]
    job = make_job(vm, scene.milo, "running", preflight={str(i): rows for i in range(workers)})
    url, headers = f"/api/v1/me/jobs/{job.pk}", _auth(scene.milo)
    client.get(url, **headers)  # the token's first use is recorded
    # The token, the job (with its VM, lab, owner and snapshot), the person's lab, that
    # they may see the VM, the parts (with their workers).
    with django_assert_num_queries(5):
        body = client.get(url, **headers).json()
    assert [p["alias"] for p in body["parts"]] == [f"pod1-w{i}" for i in range(workers)]
    last = body["parts"][-1]
    assert last["outcome"] == "running" and last["pid"] == 4000 + workers - 1
    assert last["log_url"].endswith(f"/jobs/{job.pk}/workers/{workers - 1}/log")
    assert len(body["preflight"]) == 2 * workers
    assert body["preflight"][-1] == {
        "worker": workers - 1, "check": "python", "status": "ok", "detail": "jax 0.4.35"
    }  # fmt: skip


def test_my_job_on_a_vm_i_may_no_longer_see_is_a_404(client, scene):
    job = make_job(scene.vm, scene.milo, "succeeded")
    Grant.objects.filter(user=scene.milo, vm=scene.vm).update(state="revoked")
    assert client.get(f"/api/v1/me/jobs/{job.pk}", **_auth(scene.milo)).status_code == 404


def _ended(part, when, *, status=None, signal=""):
    part.exit_status, part.signal = status, signal
    part.ended_at = timezone.now() - timezone.timedelta(seconds=when)
    part.save()


def test_a_jobs_exit_code_is_that_of_the_worker_that_failed_first(client, scene):
    vm = make_vm(scene.lab, "pod1", workers=3)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    job = make_job(vm, scene.milo, "failed")
    w0, w1, w2 = job.parts.order_by("index")
    _ended(w2, 30, status=3)  # failed first
    _ended(w0, 20, signal="TERM")  # stopped by the portal after it
    _ended(w1, 20, status=0)
    url = f"/api/v1/me/jobs/{job.pk}"
    assert client.get(url, **_auth(scene.milo)).json()["exit_code"] == 3
    _ended(w0, 40, signal="KILL")
    assert client.get(url, **_auth(scene.milo)).json()["exit_code"] == 128 + 9


@pytest.mark.parametrize(
    "state, code",
    [("succeeded", 0), ("running", None), ("queued", None), ("rejected", None),
     ("cancelled", None)],
)  # fmt: skip
def test_a_job_without_a_failed_process_has_no_exit_code_but_success_is_0(
    client, scene, state, code
):
    # The cancelled one was cancelled while it waited: nothing of it started.
    job = make_job(scene.vm, scene.milo, state, parts=None if state != "cancelled" else False)
    body = client.get(f"/api/v1/me/jobs/{job.pk}", **_auth(scene.milo)).json()
    assert body["state"] == state and body["exit_code"] == code


def test_a_running_job_cancelled_has_the_exit_code_of_its_killed_processes(client, scene):
    job = make_job(scene.vm, scene.milo, "cancelled")
    _ended(job.parts.get(), 5, signal="TERM")
    assert client.get(f"/api/v1/me/jobs/{job.pk}", **_auth(scene.milo)).json()["exit_code"] == 143

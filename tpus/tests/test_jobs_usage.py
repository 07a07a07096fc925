"""The lab's TPU usage: what holds each VM now, and worker-hours per person and per VM
over a period, on the page, as CSV and in the API; and the queries the job pages make
do not grow with the number of jobs."""

from __future__ import annotations

import csv
import datetime as dt
import io
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from portal.paging import PAGE_SIZE
from tpus.models import Grant, Job, JobWorker
from tpus.services import usage
from tpus.tests import jobs_support
from tpus.tests.jobs_support import account, make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene

UTC = dt.UTC


def at(day: int, hour: int, minute: int = 0) -> dt.datetime:
    return dt.datetime(2026, 1, day, hour, minute, tzinfo=UTC)


PERIOD = "?from=2026-01-10&to=2026-01-11"


@pytest.fixture
def history(scene):
    """Two people's jobs on a one-worker VM and a four-worker pod, around the two days
    of PERIOD (10 and 11 January 2026, UTC)."""
    pod = make_vm(scene.lab, "pod1", workers=4)
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    Grant.objects.create(user=scene.ann, vm=pod, state="active")
    # milo: 2 h of 4 on tpu5 fall in the period; 1 h of 2 on the pod, on 4 workers.
    make_job(scene.vm, scene.milo, "succeeded", started_at=at(9, 22), ended_at=at(10, 2))
    make_job(pod, scene.milo, "failed", started_at=at(11, 23), ended_at=at(12, 1))
    # ann: half an hour on tpu5, and a pod job still running since the 11th, 20:00
    # (4 h to the period's end, on 4 workers).
    make_job(scene.vm, scene.ann, "succeeded", started_at=at(10, 10), ended_at=at(10, 10, 30))
    make_job(pod, scene.ann, "running", started_at=at(11, 20))
    # Not in it: before the period, never started, refused by the pre-flight.
    make_job(scene.vm, scene.ann, "succeeded", started_at=at(5, 1), ended_at=at(5, 9))
    make_job(scene.vm, scene.ann, "queued")
    make_job(scene.vm, scene.milo, "rejected", queued_at=at(10, 5))
    return pod


def _usage(client, query=PERIOD):
    return client.get(reverse("lab_usage", args=["vision"]) + query)


def _table(body: str, table_id: str) -> list[list[str]]:
    """The rows of one table as lists of cell texts (tags and spacing removed)."""
    import re

    part = body[body.index(f'id="{table_id}"') :]
    part = part[: part.index("</table>")]
    rows = []
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", part, re.S)[1:]:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        rows.append([" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in cells])
    return rows


def test_admins_see_everyones_worker_hours_per_person_and_per_vm(client, scene, history):
    client.force_login(scene.admin)
    body = _usage(client).content.decode()
    assert _table(body, "usage-people") == [
        ["ann ann@vision.example", "2", "16.50"],
        ["milo milo@vision.example", "2", "6.00"],
    ]
    assert _table(body, "usage-vms") == [
        ["pod1 us-central1-f", "2", "20.00"],
        ["tpu5 us-central1-f", "2", "2.50"],
    ]
    assert '<strong id="usage-total">22.50</strong> worker-hours in 4 jobs' in body
    assert "Worker-hours: for each job, the time it ran" in body


def test_a_member_sees_only_their_own_worker_hours(client, scene, history):
    client.force_login(scene.milo)
    body = _usage(client).content.decode()
    assert _table(body, "usage-people") == [["milo milo@vision.example", "2", "6.00"]]
    assert _table(body, "usage-vms") == [
        ["pod1 us-central1-f", "1", "4.00"],
        ["tpu5 us-central1-f", "1", "2.00"],
    ]
    assert "ann@vision.example" not in body


def test_the_csv_has_one_row_per_person_and_vm(client, scene, history):
    client.force_login(scene.admin)
    response = client.get(reverse("lab_usage_csv", args=["vision"]) + PERIOD)
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == (
        'attachment; filename="tpu-usage-vision-20260110-20260111.csv"'
    )
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    days, zone = ["2026-01-10", "2026-01-11"], "us-central1-f"
    assert rows == [
        ["email", "username", "vm", "zone", "jobs", "worker_hours", "from", "to"],
        ["ann@vision.example", "ann", "pod1", zone, "1", "16.00", *days],
        ["ann@vision.example", "ann", "tpu5", zone, "1", "0.50", *days],
        ["milo@vision.example", "milo", "pod1", zone, "1", "4.00", *days],
        ["milo@vision.example", "milo", "tpu5", zone, "1", "2.00", *days],
    ]
    client.force_login(scene.milo)
    response = client.get(reverse("lab_usage_csv", args=["vision"]) + PERIOD)
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert [row[0] for row in rows[1:]] == ["milo@vision.example"] * 2


def test_a_csv_cell_never_starts_a_spreadsheet_formula(client, scene, make_user):
    plotter = make_user("=HYPERLINK(1)@vision.example")
    Grant.objects.create(user=plotter, vm=scene.vm, state="active")
    make_job(scene.vm, plotter, "succeeded", started_at=at(10, 1), ended_at=at(10, 2))
    client.force_login(scene.admin)
    body = client.get(reverse("lab_usage_csv", args=["vision"]) + PERIOD).content.decode()
    assert "'=hyperlink(1)@vision.example" in body


def test_a_wrong_period_is_explained_and_the_default_is_the_last_30_days(client, scene):
    client.force_login(scene.admin)
    body = _usage(client, "?from=2026-01-11&to=2026-01-10").content.decode()
    assert "The period ends before it begins." in body and 'id="usage-people"' not in body
    response = client.get(reverse("lab_usage_csv", args=["vision"]) + "?from=x&to=2026-01-01")
    assert response.status_code == 400 and "Enter a valid date" in response.content.decode()
    body = _usage(client, "").content.decode()
    today = timezone.localdate()
    assert f'value="{today:%Y-%m-%d}"' in body
    assert f'value="{today - dt.timedelta(days=29):%Y-%m-%d}"' in body


def test_a_job_running_now_counts_until_now(client, scene):
    make_job(scene.vm, scene.milo, "running", started_at=timezone.now() - dt.timedelta(hours=3))
    client.force_login(scene.milo)
    body = _usage(client, "").content.decode()
    [[_, jobs, hours]] = _table(body, "usage-people")
    assert jobs == "1" and 2.99 <= float(hours) <= 3.01


def test_the_now_table_says_what_holds_each_vm(client, scene, history):
    idle = make_vm(scene.lab, "tpu7")
    held = make_vm(scene.lab, "tpu8")
    held.outside_holders = [{"worker": 0, "device": "/dev/accel0", "pid": "77", "user": "root",
                             "command": "python3 x.py"}]  # fmt: skip
    held.usage_checked_at = timezone.now()
    held.save()
    client.force_login(scene.admin)
    body = _usage(client).content.decode()
    now = {row[0].split()[0]: row[1:] for row in _table(body, "usage-now")}
    assert now["pod1"][0].startswith("Running ann since 11 Jan 20:00")
    assert now["tpu5"] == ["Free", "1"]
    assert now["tpu7"] == ["Free", "0"]
    assert now["tpu8"][0].startswith("Held outside the portal root (pid 77, worker 0)")
    # A member sees the VMs they have access to.
    client.force_login(scene.milo)
    body = _usage(client).content.decode()
    assert sorted(row[0].split()[0] for row in _table(body, "usage-now")) == ["pod1", "tpu5"]
    assert idle.name not in body


def _api(client, user, path="", query=PERIOD):
    token = create_token(user, "t")[1]
    url = f"/api/v1/labs/vision/usage{path}{query}"
    return client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")


def test_the_api_gives_the_same_figures(client, scene, history):
    body = _api(client, scene.admin).json()
    assert (body["from_date"], body["to_date"]) == ("2026-01-10", "2026-01-11")
    assert body["worker_hours"] == 22.5 and body["jobs"] == 4
    # Each list is a page, in id order (people: milo joined before ann).
    assert [(p["username"], p["worker_hours"]) for p in body["people"]["items"]] == [
        ("milo", 6.0),
        ("ann", 16.5),
    ]
    assert (body["people"]["total"], body["people"]["next"]) == (2, None)
    assert [(v["vm"], v["worker_hours"]) for v in body["vms"]["items"]] == [
        ("tpu5", 2.5),
        ("pod1", 20.0),
    ]
    now = {n["vm"]: n for n in body["now"]["items"]}
    assert now["pod1"]["state"] == "running" and now["pod1"]["job"]["username"] == "ann"
    assert now["tpu5"]["state"] == "free" and now["tpu5"]["queue_length"] == 1
    mine = _api(client, scene.milo).json()
    assert [p["username"] for p in mine["people"]["items"]] == ["milo"]
    assert mine["worker_hours"] == 6.0 and mine["people"]["total"] == 1
    assert _api(client, scene.admin, query="?from=2026-13-01").status_code == 400
    assert _api(client, scene.admin, query="?from=2026-01-11&to=2026-01-10").status_code == 400
    assert _api(client, scene.admin, query="").json()["to_date"] == (
        timezone.localdate().isoformat()
    )


def test_the_api_pages_each_usage_list_and_honours_limit(client, scene, history, make_user):
    # Three more people with a job each in the period, and three more VMs.
    for n in range(3):
        person = make_user(f"extra{n}@vision.example")
        account(person, f"extra{n}")
        vm = make_vm(scene.lab, f"spare{n}")
        make_job(vm, person, "succeeded", started_at=at(10, 12), ended_at=at(10, 13 + n))
    body = _api(client, scene.admin, query=PERIOD + "&limit=2").json()
    assert len(body["people"]["items"]) == len(body["vms"]["items"]) == 2
    assert len(body["now"]["items"]) == 2
    assert (body["people"]["total"], body["vms"]["total"], body["now"]["total"]) == (5, 5, 5)
    assert body["jobs"] == 7  # the totals are the whole period's, not the page's

    def walk(page, period=True):
        seen = list(page["items"])
        while page["next"]:
            assert "limit=2" in page["next"]
            assert ("from=2026-01-10" in page["next"]) == period
            token = create_token(scene.admin, "t")[1]
            page = client.get(page["next"], HTTP_AUTHORIZATION=f"Bearer {token}").json()
            assert len(page["items"]) <= 2
            seen += page["items"]
        return seen

    people = walk(body["people"])
    assert [p["username"] for p in people] == ["milo", "ann", "extra0", "extra1", "extra2"]
    assert [p["worker_hours"] for p in people][2:] == [1.0, 2.0, 3.0]
    vms = walk(body["vms"])
    assert [v["vm"] for v in vms] == ["tpu5", "pod1", "spare0", "spare1", "spare2"]
    now = walk(body["now"], period=False)  # now has no period
    assert sorted(n["vm"] for n in now) == ["pod1", "spare0", "spare1", "spare2", "tpu5"]
    assert body["now"]["next"].startswith("http://testserver/api/v1/labs/vision/usage/now?")
    # Each list on its own, with the usual refusals.
    one = _api(client, scene.admin, "/people", PERIOD + "&limit=1").json()
    assert [p["username"] for p in one["items"]] == ["milo"] and one["total"] == 5
    for path, query in (
        ("", "?cursor=abc"),  # the summary has no cursor: its lists' next links do
        ("/people", "?limit=0"),
        ("/vms", "?limit=x"),
        ("/now", "?cursor=notone"),
        ("/now", "?from=2026-01-01"),
        ("/people", "?vm=tpu5"),
    ):
        response = _api(client, scene.admin, path, query)
        assert response.status_code == 400, (path, query)
        assert response.json()["detail"]


def test_reading_usage_queues_no_work(client, scene, history, monkeypatch,
                                      django_capture_on_commit_callbacks):  # fmt: skip
    from tpus import queue

    looks = []
    monkeypatch.setattr(queue, "check_tpu_usage", looks.append)
    never = make_vm(scene.lab, "tpu7")  # never looked at: the stalest there is
    Grant.objects.create(user=scene.milo, vm=never, state="active")
    token = {"HTTP_AUTHORIZATION": f"Bearer {create_token(scene.admin, 't')[1]}"}
    client.force_login(scene.admin)
    for url, headers in (
        (reverse("lab_usage", args=["vision"]), {}),
        (reverse("lab_usage_csv", args=["vision"]), {}),
        ("/api/v1/labs/vision/usage", token),
        ("/api/v1/labs/vision/usage/now", token),
        ("/api/v1/labs/vision/usage/people", token),
        ("/api/v1/labs/vision/usage/vms", token),
    ):
        # Work is queued only once the request's changes commit (tpus/queue.py).
        with django_capture_on_commit_callbacks() as queued:
            assert client.get(url, **headers).status_code == 200, url
        assert queued == [], url
    assert looks == []


# --- queries ---------------------------------------------------------------------------


def _grow(scene, pod, count: int, make_user) -> None:
    """``count`` more jobs in every state, spread over more people and both VMs, each
    started one with a part per worker; made in bulk."""
    people = [scene.milo, scene.ann]
    while len(people) < max(2, count // 5):
        person = make_user(f"p{len(people)}x{count}@vision.example")
        account(person, f"p{len(people)}x{count}")
        people.append(person)
    states = ["succeeded", "failed", "cancelled", "lost", "rejected", "queued", "blocked"]
    now = timezone.now()
    jobs = []
    sizes = {vm.pk: vm.workers.count() for vm in (scene.vm, pod)}
    for n in range(count):
        state = states[n % len(states)]
        started = (
            now - dt.timedelta(hours=n % 48 + 1)
            if state not in ("queued", "blocked", "rejected")
            else None
        )
        jobs.append(
            Job(
                vm=pod if n % 2 else scene.vm,
                user=people[n % len(people)],
                host_id=f"grow-{count}-{n}",
                state=state,
                args=["python3", f"run{n}.py"],
                started_at=started,
                ended_at=started + dt.timedelta(minutes=30) if started else None,
                queued_at=now - dt.timedelta(hours=n % 48 + 2),
                worker_count=sizes[(pod if n % 2 else scene.vm).pk] if started else 0,
            )
        )
    Job.objects.bulk_create(jobs)
    workers = {vm.pk: list(vm.workers.all()) for vm in (scene.vm, pod)}
    JobWorker.objects.bulk_create(
        JobWorker(job=job, worker=w, index=w.index, state="ended", exit_status=0)
        for job in jobs
        if job.started_at
        for w in workers[job.vm_id]
    )


def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as context:
        response = client.get(url)
        assert response.status_code == 200, response.content[:500]
        b"".join(response) if response.streaming else response.content
    return len(context)


def _cold_queries(client, url, lab) -> int:
    """The queries of ``url`` when the lab's figures are not in the cache."""
    from django.core.cache import cache

    cache.delete(f"tpu-portal:usage-version:{lab.pk}")
    return _queries(client, url)


@pytest.mark.parametrize(
    "page",
    [
        "lab_usage",
        "lab_usage_csv",
        "api_usage",
        "api_usage_people",
        "api_usage_vms",
        "api_usage_now",
        "vm_detail",
        "job_detail",
        "api_jobs",
    ],
)
@pytest.mark.parametrize("who", ["admin", "milo"])
def test_the_job_pages_make_as_many_queries_for_200_jobs_as_for_5(
    client, scene, make_user, page, who
):
    pod = make_vm(scene.lab, "pod1", workers=4)
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    running = make_job(pod, scene.milo, "running", started_at=timezone.now())
    user = scene.admin if who == "admin" else scene.milo
    token = create_token(user, "t")[1]
    client.force_login(user)
    url = {
        "lab_usage": reverse("lab_usage", args=["vision"]),
        "lab_usage_csv": reverse("lab_usage_csv", args=["vision"]),
        "api_usage": "/api/v1/labs/vision/usage",
        "api_usage_people": "/api/v1/labs/vision/usage/people?limit=3",
        "api_usage_vms": "/api/v1/labs/vision/usage/vms?limit=1",
        "api_usage_now": "/api/v1/labs/vision/usage/now?limit=1",
        "vm_detail": reverse("vm_detail", args=["vision", pod.pk]),
        "job_detail": reverse("job_detail", args=["vision", pod.pk, running.pk]),
        "api_jobs": f"/api/v1/labs/vision/vms/{pod.pk}/jobs?limit=200",
    }[page]
    if page.startswith("api_"):
        client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    _grow(scene, pod, 5, make_user)
    _queries(client, url)  # the first visit makes the lab's key pair and such, once
    few = _queries(client, url)  # the period's sums from the cache
    cold = _cold_queries(client, url, scene.lab)  # and from the database
    _grow(scene, pod, 200, make_user)
    assert Job.objects.count() > 200
    _queries(client, url)  # the sums of the rows of the people with new jobs, once
    assert _queries(client, url) == few  # the new jobs read one by one
    assert _cold_queries(client, url, scene.lab) == cold
    usage.count_all_ended_jobs()
    _queries(client, url)
    assert _queries(client, url) == few  # and summed from the per-day rows
    assert _cold_queries(client, url, scene.lab) == cold


def test_the_usage_page_has_the_database_sort_and_page_the_people(client, scene, make_user):
    pod = make_vm(scene.lab, "pod1", workers=4)
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    make_job(pod, scene.milo, "running", started_at=timezone.now())
    _grow(scene, pod, 300, make_user)  # 60 people
    usage.count_all_ended_jobs()
    client.force_login(scene.admin)

    with CaptureQueriesContext(connection) as context:  # nothing in the cache yet
        page = _usage(client, "?people=2").content.decode()

    # Summed per person or VM in the database: each such query is a page (LIMIT) or
    # the few with a job running now, never everyone to be sorted here; the charts'
    # sums are a row per day for each of a few people or VMs, and one for the rest.
    grouped = [q["sql"] for q in context.captured_queries if "tpus_usageday" in q["sql"]]
    grouped = [q for q in grouped if "GROUP BY" in q]
    per_day = [
        q
        for q in grouped
        if q.startswith('SELECT "tpus_usageday"."day"') and q.endswith("GROUP BY 1, 2")
    ]
    assert per_day and all("LIMIT" in q or " IN (" in q or q in per_day for q in grouped), grouped
    # The second page holds what ranking everyone would put there.
    figures = usage.Usage(scene.lab, usage.Period.last_days())
    second = usage.name_people(usage.most_used_first(figures.grouped("user"))[PAGE_SIZE:])
    table = page.split('id="usage-people"')[1].split("</table>")[0]
    shown = re.findall(r'<span class="help">([^<]+)</span>', table)
    assert second and shown == [row["email"] for row in second]


# --- a fresh look at the chips -----------------------------------------------------------


def test_opening_a_vm_page_looks_again_at_chips_last_seen_long_ago(
    client, scene, settings, monkeypatch
):
    from django.core.cache import cache

    from tpus import queue

    looks = []
    monkeypatch.setattr(queue, "check_tpu_usage", looks.append)
    settings.PORTAL_JOB_USAGE_REFRESH_SECONDS = 30
    busy = make_vm(scene.lab, "tpu6")
    Grant.objects.create(user=scene.milo, vm=busy, state="active")
    make_job(busy, scene.ann, "running")  # its poll looks at the chips anyway
    fresh = make_vm(scene.lab, "tpu7", usage_checked_at=timezone.now())
    Grant.objects.create(user=scene.milo, vm=fresh, state="active")
    client.force_login(scene.milo)
    for vm in (scene.vm, busy, fresh):
        for name in ("vm_detail", "vm_jobs"):
            looks.clear()
            cache.delete(f"tpu-portal:usage-look:{vm.pk}")  # as a period later
            assert client.get(reverse(name, args=["vision", vm.pk])).status_code == 200
            # never looked at: stale; tpu6 busy; tpu7 fresh
            assert looks == ([scene.vm.pk] if vm == scene.vm else []), (name, vm)
    # Many people opening the page within one period queue one look, not one each.
    looks.clear()
    cache.delete(f"tpu-portal:usage-look:{scene.vm.pk}")
    for _ in range(3):
        client.get(reverse("vm_detail", args=["vision", scene.vm.pk]))
    assert looks == [scene.vm.pk]

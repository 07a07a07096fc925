"""A pod's "Provisioning on each worker" table: neighbouring workers in the same
state are one line, so 32 workers in step read as one, and any worker that is not
stands out on its own line."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from tpus.models import TpuVm, Worker, WorkerSync

KEYS = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHk0Yx2hP9vF1aQ0bCq3l4mWc7S1RkGzj0Q7H3p5sT2a"]


@pytest.fixture
def pod(cast):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central2-b", desired_version=3)
    now = timezone.now()
    for index in range(6):
        worker = Worker.objects.create(
            vm=vm, index=index, external_ip=f"192.0.2.{index + 1}", host_keys=KEYS
        )
        sync = {"applied_version": 3, "last_report": {"values": {"changed": "0"}}}
        sync["last_success_at"] = now - dt.timedelta(minutes=index + 1)
        if index == 3:  # one worker failing in the middle of the pod
            sync = {"applied_version": 2, "last_error": "connection refused", "failures": 1}
        WorkerSync.objects.create(worker=worker, **sync)
    return vm


def _rows(client, cast, vm) -> list[str]:
    client.force_login(cast.admin)
    body = client.get(reverse("vm_progress", args=[cast.lab.slug, vm.pk])).content.decode()
    return [row.split("</tr>")[0] for row in body.split('<tr id="worker-sync-')[1:]]


def test_workers_in_step_are_one_line_and_a_failing_one_stands_alone(client, cast, pod):
    rows = _rows(client, cast, pod)
    assert [r.split('"')[0] for r in rows] == ["0", "3", "4"]
    first, failing, last = rows
    assert "tpu5-w0 – tpu5-w2 (3 workers)" in first and "up to date" in first
    assert "in step" in first and "3\xa0minutes ago" in first  # the oldest of the three
    assert "tpu5-w3<" in failing and "failed" in failing and "connection refused" in failing
    assert "tpu5-w4 – tpu5-w5 (2 workers)" in last and "6\xa0minutes ago" in last


def test_a_worker_that_never_succeeded_is_not_folded_into_its_neighbours(client, cast, pod):
    WorkerSync.objects.filter(worker__vm=pod, worker__index=5).update(last_success_at=None)
    rows = _rows(client, cast, pod)
    assert [r.split('"')[0] for r in rows] == ["0", "3", "4", "5"]
    assert "never" in rows[-1] and "tpu5-w5<" in rows[-1]


def test_a_worker_without_host_keys_says_so_on_its_own_line(client, cast, pod):
    Worker.objects.filter(vm=pod, index=1).update(host_keys=[])
    WorkerSync.objects.filter(worker__vm=pod, worker__index=1).update(applied_version=0)
    rows = _rows(client, cast, pod)
    assert [r.split('"')[0] for r in rows] == ["0", "1", "2", "3", "4"]
    assert "host keys not confirmed" in rows[1]


def test_a_grant_in_flight_comes_first_and_keeps_the_page_polling(client, cast, pod, make_user):
    """Twenty grants changed in the last minutes, and one still pending from an hour
    ago: it leads the list, and the live part keeps asking."""
    from tpus.models import Grant

    now = timezone.now()
    for i in range(20):
        grant = Grant.objects.create(user=make_user(f"p{i}@vision.example"), vm=pod)
        Grant.objects.filter(pk=grant.pk).update(state="active", changed_at=now)
    stuck = Grant.objects.create(user=cast.member, vm=pod)
    Grant.objects.filter(pk=stuck.pk).update(changed_at=now - dt.timedelta(hours=1))
    client.force_login(cast.admin)
    body = client.get(reverse("vm_progress", args=[cast.lab.slug, pod.pk])).content.decode()
    assert 'hx-trigger="every 1s"' in body
    assert re.search(r'<tr id="grant-(\d+)"', body)[1] == str(stuck.pk)
    Grant.objects.filter(pk=stuck.pk).update(state="active")
    body = client.get(reverse("vm_progress", args=[cast.lab.slug, pod.pk])).content.decode()
    assert "hx-trigger" not in body


def test_changes_in_progress_lists_only_what_is_still_changing(client, cast, pod, make_user):
    """A grant that became active a minute ago is shown apart, as finished; one from
    ten minutes ago is old news, only on the access list; nothing is in progress."""
    from tpus.models import Grant

    now = timezone.now()
    just = Grant.objects.create(user=make_user("just@vision.example"), vm=pod)
    old = Grant.objects.create(user=make_user("old@vision.example"), vm=pod)
    Grant.objects.filter(pk=just.pk).update(
        state="active", changed_at=now - dt.timedelta(minutes=1)
    )
    Grant.objects.filter(pk=old.pk).update(
        state="active", changed_at=now - dt.timedelta(minutes=10)
    )
    client.force_login(cast.admin)

    body = client.get(reverse("vm_progress", args=[cast.lab.slug, pod.pk])).content.decode()

    in_progress, finished = body.split("<h2>Provisioning on each worker</h2>")[0].split(
        "Finished in the last 5 minutes"
    )
    assert "Nothing is changing on tpu5 right now." in in_progress
    assert 'id="grant-' not in in_progress
    assert f'id="grant-{just.pk}"' in finished and "old@vision.example" not in body
    assert "hx-trigger" not in body  # nothing to follow

    # A change under way is listed under "Changes in progress", the finished one apart.
    moving = Grant.objects.create(user=make_user("moving@vision.example"), vm=pod)
    body = client.get(reverse("vm_progress", args=[cast.lab.slug, pod.pk])).content.decode()
    in_progress, finished = body.split("Finished in the last 5 minutes")
    assert f'id="grant-{moving.pk}"' in in_progress and f'id="grant-{just.pk}"' not in in_progress
    assert f'id="grant-{just.pk}"' in finished
    assert 'hx-trigger="every 1s"' in body

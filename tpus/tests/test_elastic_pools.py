"""A lab's elastic pool of a kind, against the emulator: off until a lab admin switches
it on; grows by exactly the VMs the waiting jobs of people with a kind grant need,
never past the allowance (even with passes at the same moment) nor after the lab's
grant ended; deletes a VM it made once idle past its limit, never one with a job."""

from __future__ import annotations

import datetime as dt
import itertools
import threading

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import DatabaseError, connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tpus.models import AuditEvent, ElasticPool, Grant, Job, LabAllowance, TpuVm, VmRequest
from tpus.models.provisioning import OPEN_REQUEST_STATES
from tpus.services import elastic_admin, elastic_pass, elastic_pools, scheduler
from tpus.services.jobs import JobSpec, Kind, submit_pool_job
from tpus.services.kind_grants import grant_kind
from tpus.tests.jobs_support import account, make_job

PROJECT = "vision-project"
ZONE = "us-central2-b"
VERSION = "tpu-ubuntu2204-base"


@pytest.fixture
def lab(cast, make_user, add_member, tpu_emulator):
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=20)
    account(cast.member, "milo")
    account(cast.admin, "boss")
    ann = make_user("ann@vision.example")
    add_member(lab, ann)
    account(ann, "ann")
    lab.ann = ann
    grant_kind(cast.admin, lab, cast.member, "v4-8", sudo=False)
    # Nothing arrives unless a test lets capacity come.
    tpu_emulator.controls.set_capacity(ZONE, "v4-8", 0)
    return lab


def switch_on(cast, lab, **fields):
    values = dict(enabled=True, provisioning="spot", zones=[ZONE], runtime_version=VERSION)
    return elastic_admin.set_pool(cast.admin, lab, "v4-8", **{**values, **fields})


_host_ids = itertools.count(1)


def wait(lab, user, n=1):
    """Jobs waiting for any v4-8, as a submit stores them (without its look at the pool)."""
    return [
        Job.objects.create(
            lab=lab,
            user=user,
            accelerator_type="v4-8",
            args=["true"],
            host_id=f"elastic-{next(_host_ids)}",
        )
        for _ in range(n)
    ]


def pool_requests(lab):
    return VmRequest.objects.filter(lab=lab, elastic_pool__isnull=False).order_by("pk")


def test_a_kinds_pool_is_off_until_an_admin_switches_it_on(cast, lab):
    wait(lab, cast.member, 2)
    elastic_pass.run_all()
    assert not VmRequest.objects.exists()
    # Without a VM of the kind, a job cannot even wait for one.
    with pytest.raises(PermissionDenied):
        submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
    assert elastic_admin.views(lab)[0].enabled is False


def test_switching_it_on_is_audited_and_checked_field_by_field(cast, lab):
    with pytest.raises(ValidationError) as refused:
        switch_on(cast, lab, provisioning="on-demand", zones=["europe-west4-a"], idle_minutes=0)
    assert set(refused.value.message_dict) == {"provisioning", "zones", "idle_minutes"}
    with pytest.raises(ValidationError) as refused:
        switch_on(cast, lab, runtime_version="tpu-vm-tf-9")
    assert "has no runtime version tpu-vm-tf-9" in refused.value.message_dict["runtime_version"][0]
    assert not ElasticPool.objects.exists()
    with pytest.raises(PermissionDenied):
        elastic_admin.set_pool(cast.member, lab, "v4-8", enabled=False)
    pool = switch_on(cast, lab, max_vms=3)
    assert (pool.enabled, pool.idle_minutes, pool.max_vms) == (True, 30, 3)
    event = AuditEvent.objects.get(action="elastic_pool.set")
    assert event.actor == cast.admin and "v4-8 elastic pool on: spot" in event.summary


def test_it_grows_by_exactly_what_the_waiting_jobs_need(
    cast, lab, django_capture_on_commit_callbacks
):
    switch_on(cast, lab)
    with django_capture_on_commit_callbacks(execute=True):
        jobs = [
            submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
            for _ in range(3)
        ]
    assert all(job.vm_id is None for job in jobs)
    made = list(pool_requests(lab))
    # Each submit grew the pool in its own transaction: one VM per job, each asked for
    # as the submit committed (sent at once), with the jobs and chips as they stood.
    assert [r.name for r in made] == ["v4-8-pool-1", "v4-8-pool-2", "v4-8-pool-3"]
    assert all(r.queued and r.provisioning == "spot" and r.requested_by is None for r in made)
    assert {r.state for r in made} == {"waiting"}  # queued at Google: no capacity
    assert made[0].elastic_reason == "1 job waits; allowance 0 of 5 spot v4-8 in use"
    assert made[1].elastic_reason == "2 jobs wait; allowance 1 of 5 spot v4-8 in use"
    assert made[2].elastic_reason == "3 jobs wait; allowance 2 of 5 spot v4-8 in use"
    elastic_pass.run_all()
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 3
    assert AuditEvent.objects.filter(action="elastic_pool.grew").count() == 3
    assert ElasticPool.objects.get().refused == "capacity at Google: queued, waiting for resources"
    # A job cancelled: the open request stays (Google may bring it), none is added.
    Job.objects.filter(pk=jobs[0].pk).update(state="cancelled")
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 3


def test_a_submit_asks_in_its_own_transaction_and_a_failed_look_falls_back(
    cast, lab, monkeypatch, django_capture_on_commit_callbacks
):
    switch_on(cast, lab)
    with django_capture_on_commit_callbacks(execute=False) as sent:
        submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
        # Asked for before the submit's commit; sending it is what the commit queues.
        (made,) = pool_requests(lab)
        assert made.state == "requested"
    assert len(sent) == 1
    assert AuditEvent.objects.filter(action="elastic_pool.grew", data__request=made.pk).exists()
    # A look that fails is undone alone: the job stands, and the pool's task asks.

    def broken(lab_id, accelerator_type, **kwargs):
        VmRequest.objects.update(name="x")  # undone with the look
        raise DatabaseError("the look failed")

    monkeypatch.setattr(elastic_pass, "grow_kind", broken)
    with django_capture_on_commit_callbacks(execute=True):
        second = submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
    assert Job.objects.get(pk=second.pk).state == "queued"
    assert [r.name for r in pool_requests(lab)] == ["v4-8-pool-1", "v4-8-pool-2"]


def test_a_submit_that_grows_the_pool_reads_each_row_once(
    cast, lab, django_capture_on_commit_callbacks
):
    """The pool's look in a submit reuses what the submit read with the lab's row
    locked (the lab, the people with a kind grant), and the request's claim what the
    look read: a pinned number of queries, whatever the VMs and jobs."""
    switch_on(cast, lab)
    submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
    with (
        CaptureQueriesContext(connection) as captured,
        django_capture_on_commit_callbacks(execute=False),
    ):
        submit_pool_job(cast.member, lab, Kind("v4-8"), JobSpec(args=["true"]))
    assert pool_requests(lab).count() == 2
    assert len(captured) <= 31, "\n".join(q["sql"][:120] for q in captured)


def test_it_grows_only_within_each_persons_chip_limit(cast, lab):
    # 8 chips each: one v4-8 (4 chips) running and one more; the third job would not be
    # placed on a new VM either, so no VM is asked for it.
    lab.max_chips_per_person = 8
    lab.save()
    switch_on(cast, lab)
    wait(lab, cast.member, 3)
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 2
    lab.max_chips_per_person = 0  # no limit
    lab.save()
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 3


def test_it_never_grows_past_the_allowance(cast, lab):
    LabAllowance.objects.filter(lab=lab).update(chips=8)  # two v4-8
    switch_on(cast, lab)
    wait(lab, cast.member, 3)
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 2
    pool = ElasticPool.objects.get()
    assert pool.refused == "allowance full: allowance 2 of 2 spot v4-8 in use"
    views = {v.accelerator_type: v for v in elastic_admin.views(lab)}
    assert [r["reason"] for r in views["v4-8"].requests] == [
        "3 jobs wait; allowance 0 of 2 spot v4-8 in use",
        "3 jobs wait; allowance 1 of 2 spot v4-8 in use",
    ]


def test_it_stops_at_the_pools_maximum(cast, lab):
    switch_on(cast, lab, max_vms=1)
    wait(lab, cast.member, 3)
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 1
    assert ElasticPool.objects.get().refused == "the pool holds its maximum of 1 VMs"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("chips, made", [(8, 2), (20, 3)])
def test_passes_at_the_same_moment_never_ask_past_the_allowance_or_the_need(
    cast, lab, monkeypatch, chips, made
):
    """Four passes meet after reading the pool (if they can: with the lab's row locked
    the others wait for the first, and the meeting times out). Without the lock each
    would ask for every waiting job; with it, three jobs make three requests with room
    for five, two with room for two."""
    LabAllowance.objects.filter(lab=lab).update(chips=chips)
    switch_on(cast, lab)
    wait(lab, cast.member, 3)
    meet = threading.Barrier(4)
    original = elastic_pools.read

    def read_then_meet(pool, **kwargs):
        scene = original(pool, **kwargs)
        try:
            meet.wait(timeout=2)
        except threading.BrokenBarrierError:
            pass
        return scene

    monkeypatch.setattr(elastic_pools, "read", read_then_meet)
    errors = []

    def run():
        try:
            elastic_pass.run_all()
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert pool_requests(lab).count() == made
    assert VmRequest.objects.filter(lab=lab, state__in=OPEN_REQUEST_STATES).count() == made


def test_nothing_is_asked_for_after_the_labs_grant_ended(cast, lab):
    switch_on(cast, lab)
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    wait(lab, cast.member, 2)
    elastic_pass.run_all()
    assert not VmRequest.objects.exists()
    assert "grant ended" in ElasticPool.objects.get().refused


def test_jobs_of_people_without_a_kind_grant_do_not_grow_it_and_say_so(cast, lab):
    switch_on(cast, lab)
    # ann may use one named VM only: a VM the pool makes would never be hers.
    named = TpuVm.objects.create(
        lab=lab, name="tpu9", zone=ZONE, source="manual", accelerator_type="v4-8", state="READY"
    )
    Grant.objects.create(user=lab.ann, vm=named, state="active")
    make_job(named, lab.ann, "running")
    (hers,) = wait(lab, lab.ann)
    elastic_pass.run_all()
    assert not VmRequest.objects.exists()
    why = scheduler.why_they_wait(lab.pk)[hers.pk]
    assert "elastic pool makes VMs only for people with access to every v4-8" in why
    (his,) = wait(lab, cast.member)
    elastic_pass.run_all()
    assert pool_requests(lab).count() == 1
    assert "v4-8 elastic pool has asked Google for a VM" in scheduler.why_they_wait(lab.pk)[his.pk]


def pool_vm(emulator, pool, name, *, idle_minutes: int):
    """A VM the pool made, up since ``idle_minutes`` ago, as the emulator has it too."""
    emulator.controls.add_node(PROJECT, ZONE, name, accelerator_type="v4-8", spot=True)
    vm = TpuVm.objects.create(
        lab=pool.lab, name=name, zone=ZONE, source="created", accelerator_type="v4-8",
        state="READY", preemptible=True,
    )  # fmt: skip
    VmRequest.objects.create(
        lab=pool.lab, name=name, zone=ZONE, accelerator_type="v4-8", runtime_version=VERSION,
        provisioning="spot", state="ready", vm=vm, elastic_pool=pool,
        ready_at=timezone.now() - dt.timedelta(minutes=idle_minutes),
    )  # fmt: skip
    return vm


def nodes(emulator) -> str:
    return str(emulator.controls.show().get("nodes", {}))


def test_an_idle_pool_vm_goes_after_its_limit_but_not_one_with_a_job(
    cast, lab, tpu_emulator, django_capture_on_commit_callbacks
):
    pool = switch_on(cast, lab, idle_minutes=30)
    pool_vm(tpu_emulator, pool, "v4-8-pool-1", idle_minutes=31)
    pool_vm(tpu_emulator, pool, "v4-8-pool-2", idle_minutes=29)
    busy = pool_vm(tpu_emulator, pool, "v4-8-pool-3", idle_minutes=120)
    make_job(busy, cast.member, "running")
    # A VM that ran a job until a minute ago is idle from then on.
    ran = pool_vm(tpu_emulator, pool, "v4-8-pool-4", idle_minutes=120)
    make_job(ran, cast.member, "succeeded")
    # A job placed there and not started yet holds it too.
    placed = pool_vm(tpu_emulator, pool, "v4-8-pool-5", idle_minutes=120)
    make_job(placed, cast.member, "queued", lab=lab, accelerator_type="v4-8")
    assert "v4-8-pool-1" in nodes(tpu_emulator)
    with django_capture_on_commit_callbacks(execute=True):
        elastic_pass.run_all()
    gone = dict(TpuVm.objects.filter(lab=lab).values_list("name", "missing_since"))
    assert gone["v4-8-pool-1"] is not None  # deleted at Google and gone from the lab
    assert {gone[f"v4-8-pool-{n}"] for n in (2, 3, 4, 5)} == {None}
    assert "v4-8-pool-1" not in nodes(tpu_emulator)
    assert "v4-8-pool-2" in nodes(tpu_emulator)
    shrank = AuditEvent.objects.get(action="elastic_pool.shrank")
    assert shrank.summary.startswith("v4-8-pool-1: deleted by the v4-8 elastic pool after 31 min")


def test_an_idle_pool_vm_stays_while_a_waiting_job_could_take_it(cast, lab, tpu_emulator):
    pool = switch_on(cast, lab, idle_minutes=30)
    pool_vm(tpu_emulator, pool, "v4-8-pool-1", idle_minutes=60)
    wait(lab, cast.member)  # milo's account there is not active yet, say
    elastic_pass.run_all()
    assert TpuVm.objects.get(name="v4-8-pool-1").missing_since is None
    assert not VmRequest.objects.filter(state__in=OPEN_REQUEST_STATES).exists()


def test_a_preempted_pool_vm_is_not_counted_and_goes_once_idle_past_its_limit(
    cast, lab, tpu_emulator, django_capture_on_commit_callbacks
):
    """Not kept alive: Google took it back, so its job (run again) waits; the pool asks
    for another VM for it, and deletes the preempted one once past its idle limit."""
    pool = switch_on(cast, lab, idle_minutes=30)
    vm = pool_vm(tpu_emulator, pool, "v4-8-pool-1", idle_minutes=45)
    TpuVm.objects.filter(pk=vm.pk).update(state="PREEMPTED")
    tpu_emulator.controls.preempt("v4-8-pool-1")
    wait(lab, cast.member)
    with django_capture_on_commit_callbacks(execute=True):
        elastic_pass.run_all()
    # Named past the one the lab still has a row of.
    assert [r.name for r in pool_requests(lab).filter(state__in=OPEN_REQUEST_STATES)] == [
        "v4-8-pool-2"
    ]
    assert TpuVm.objects.get(pk=vm.pk).missing_since is not None
    assert not VmRequest.objects.filter(keep_alive=True).exists()


def test_another_labs_pool_is_a_404(cast, lab):
    client = Client()
    client.force_login(cast.outsider)
    url = f"/api/v1/labs/{lab.slug}/elastic-pools/v4-8"
    answer = client.put(url, {"enabled": False}, content_type="application/json")
    assert answer.status_code == 404
    assert client.get(f"/api/v1/labs/{lab.slug}/elastic-pools").status_code == 404
    assert not ElasticPool.objects.exists()


def test_the_api_switches_it_on_and_shows_what_it_asked_for(cast, lab):
    client = Client()
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{lab.slug}/elastic-pools/v4-8"
    body = {"enabled": True, "zones": [ZONE], "runtime_version": VERSION, "idle_minutes": 10}
    answer = client.put(url, body, content_type="application/json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["enabled"] is True and answer.json()["idle_minutes"] == 10
    wait(lab, cast.member, 2)
    elastic_pass.run_all()
    (pool,) = [p for p in client.get(url.rsplit("/", 1)[0]).json() if p["enabled"]]
    assert [r["reason"] for r in pool["requests"]] == [
        "2 jobs wait; allowance 0 of 5 spot v4-8 in use",
        "2 jobs wait; allowance 1 of 5 spot v4-8 in use",
    ]
    bad = client.put(url, {**body, "provisioning": "on-demand"}, content_type="application/json")
    assert bad.status_code == 400 and "spot or preemptible" in bad.json()["detail"]


def test_the_kinds_page_shows_each_pool_and_switches_one_on(cast, lab, tpu_emulator):
    client = Client()
    client.force_login(cast.admin)
    page = client.get(f"/labs/{lab.slug}/kinds/").content.decode()
    assert 'id="pool-v4-8"' in page and "off" in page
    # The pools are one section of the page's body: not in its title, not in its head.
    assert page.count('id="elastic-pools"') == 1
    assert "<h2>Elastic pools</h2>" not in page.split("</head>")[0]
    form = {
        "accelerator_type": "v4-8",
        "enabled": "on",
        "provisioning": "spot",
        "zones": [ZONE],
        "runtime_version": VERSION,
        "idle_minutes": "20",
    }
    assert client.post(f"/labs/{lab.slug}/kinds/elastic/", form).status_code == 302
    pool = ElasticPool.objects.get()
    assert (pool.enabled, pool.idle_minutes) == (True, 20)
    LabAllowance.objects.filter(lab=lab).update(chips=4)
    wait(lab, cast.member, 2)
    elastic_pass.run_all()
    page = client.get(f"/labs/{lab.slug}/kinds/").content.decode()
    assert "v4-8-pool-1: requested (2 jobs wait; allowance 0 of 1 spot v4-8 in use)" in page
    assert "allowance full: allowance 1 of 1 spot v4-8 in use" in page
    vm = pool_vm(tpu_emulator, pool, "v4-8-pool-9", idle_minutes=5)
    page = client.get(f"/labs/{lab.slug}/vms/{vm.pk}/").content.decode()
    assert "made by the v4-8 elastic pool; deleted after 20 min idle" in page
    # Another lab's admin: the lab is not there.
    other = Client()
    other.force_login(cast.outsider)
    assert other.post(f"/labs/{lab.slug}/kinds/elastic/", form).status_code == 404
    assert AuditEvent.objects.filter(action="elastic_pool.set").count() == 1

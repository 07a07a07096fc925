"""The pool and kind grants: a kind grant gives a person an account on each VM of the
kind, and placement puts their job only where that account is in force (the VM grant
active), whatever the kind grant says."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext

from portal import outbox
from portal.models import OutboxMessage
from tpus import queue
from tpus.models import Grant, Job, LabAllowance, TpuVm, Worker, WorkerSync
from tpus.services import grants as grant_services
from tpus.services import reconcile, scheduler
from tpus.services.jobs import JobSpec, Kind, submit_pool_job
from tpus.services.kind_grants import grant_kind
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_vm

scene = jobs_support.scene
PIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


@pytest.fixture
def passes(monkeypatch):
    queued = []
    monkeypatch.setattr(scheduler.queue, "advance_jobs", queued.append)
    return queued


def pool_vm(lab, name, *, pinned=True):
    vm = make_vm(lab, name, state=TpuVm.State.READY)
    if pinned:
        Worker.objects.filter(vm=vm).update(host_keys=[PIN])
    return vm


def test_a_job_goes_only_where_the_kind_grant_has_made_an_active_grant(scene, passes):
    scene.vm.delete()
    LabAllowance.objects.create(lab=scene.lab, generation="v4", provisioning="spot", chips=8)
    pending = pool_vm(scene.lab, "a-pending")
    revoked = pool_vm(scene.lab, "b-revoked")
    unpinned = pool_vm(scene.lab, "c-unpinned", pinned=False)
    grant_kind(scene.admin, scene.lab, scene.milo, "v4-8", sudo=False)
    grant_services.revoke_access(scene.admin, Grant.objects.get(vm=revoked))
    assert not Grant.objects.filter(vm=unpinned).exists()
    # Someone else's account on the unpinned VM is not milo's.
    Grant.objects.create(user=scene.ann, vm=unpinned, state="active")
    # A job waiting from before (submitting one needs an active grant of the kind).
    job = Job.objects.create(
        lab=scene.lab, user=scene.milo, accelerator_type="v4-8", host_id="k-1", args=["true"]
    )
    assert scheduler.place(scene.lab.pk) == []  # milo's only grant is still pending
    Grant.objects.filter(vm=pending).update(state="active")
    assert [p.vm_id for p in scheduler.place(scene.lab.pk)] == [pending.pk]
    job.refresh_from_db()
    assert job.vm_id == pending.pk and passes == [pending.pk]
    # Once there, the next job of milo's waits for it: the others are not his.
    submit_pool_job(scene.milo, scene.lab, Kind("v4-8"), JobSpec(args=["true"]))
    assert scheduler.place(scene.lab.pk) == []


def queries_of_a_placement(scene, vms: int) -> int:
    for index in range(vms):
        vm = pool_vm(scene.lab, f"n{vms}-{index}")
        Grant.objects.create(user=scene.ann, vm=vm, state="active")
    grant_kind(scene.admin, scene.lab, scene.milo, "v4-8", sudo=False)
    Grant.objects.filter(user=scene.milo).update(state="active")
    for index in range(vms):
        Job.objects.create(
            lab=scene.lab,
            user=(scene.milo, scene.ann)[index % 2],
            accelerator_type="v4-8",
            host_id=f"k{vms}-{index}",
            args=["true"],
        )
    with CaptureQueriesContext(connection) as captured:
        placed = scheduler.place(scene.lab.pk)
    assert len(placed) == vms
    Job.objects.filter(lab=scene.lab).delete()
    TpuVm.objects.filter(lab=scene.lab).delete()
    return len(captured)


def test_placement_with_kind_grants_costs_the_same_queries_for_any_size(scene, passes):
    scene.vm.delete()
    assert queries_of_a_placement(scene, 2) == queries_of_a_placement(scene, 20)


def test_placing_one_job_on_one_free_vm_reads_no_row_twice(scene, passes):
    """Every decision taken by the UPDATE and no job back from a lost VM: nothing is
    read back after it."""
    scene.vm.delete()
    vm = pool_vm(scene.lab, "a-free")
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    job = Job.objects.create(
        lab=scene.lab, user=scene.milo, accelerator_type="v4-8", host_id="k-1q", args=["true"]
    )
    with CaptureQueriesContext(connection) as captured:
        placed = scheduler.place(scene.lab.pk, "v4-8")
    assert [(p.job_id, p.vm_id) for p in placed] == [(job.pk, vm.pk)]
    assert passes == [vm.pk]
    assert len(captured) <= 9, "\n".join(q["sql"][:120] for q in captured)


def _pool_vm_grant_and_waiting_job(scene, host_id: str):
    """The elastic pool's VM (the scene's own gone), milo's grant on it from his kind
    grant (not yet applied by any worker), and his job waiting for any v4-8."""
    scene.vm.delete()
    vm = pool_vm(scene.lab, "v4-8-pool-1")
    grant_kind(scene.admin, scene.lab, scene.milo, "v4-8", sudo=False)
    grant = Grant.objects.get(vm=vm, user=scene.milo)
    job = Job.objects.create(
        lab=scene.lab, user=scene.milo, accelerator_type="v4-8", host_id=host_id, args=["true"]
    )
    return vm, grant, job


def test_the_settle_that_puts_the_grant_in_force_places_the_waiting_job(scene, passes):
    """A VM the elastic pool made: once every worker has applied the account the kind
    grant gave, the settle that puts the grant in force gives the waiting job the VM
    and queues that VM's pass, which starts it (no later look places it)."""
    vm, grant, job = _pool_vm_grant_and_waiting_job(scene, "k-s")
    reconcile.settle_grants(vm.pk)  # no worker has applied it yet
    assert (Job.objects.get(pk=job.pk).vm_id, passes) == (None, [])
    for worker in vm.workers.all():
        WorkerSync.objects.create(worker=worker, applied_version=grant.version)
    reconcile.settle_grants(vm.pk)
    grant.refresh_from_db()
    job.refresh_from_db()
    assert grant.state == "active" and job.vm_id == vm.pk and job.placed_at is not None
    assert passes == [vm.pk]


def test_a_reconcile_that_puts_the_grant_in_force_starts_the_placed_job_itself(scene, passes):
    """The reconcile's own settle (``starts_jobs``) places the waiting job as the
    other does, and queues no pass for it: the reconcile starts it, over the
    connections it has just used (``tasks.reconcile_vm``)."""
    vm, grant, job = _pool_vm_grant_and_waiting_job(scene, "k-r")
    assert reconcile.settle_grants(vm.pk, starts_jobs=True) is False  # not applied yet
    for worker in vm.workers.all():
        WorkerSync.objects.create(worker=worker, applied_version=grant.version)
    assert reconcile.settle_grants(vm.pk, starts_jobs=True) is True
    job.refresh_from_db()
    assert job.vm_id == vm.pk and job.placed_at is not None
    assert passes == []


@pytest.mark.django_db(transaction=True)
def test_the_vms_pass_is_queued_before_the_activation_email_is_first_sent(scene, monkeypatch):
    """The email is stored with the grant's change; its first send (a call to the SMTP
    server) comes after the waiting job is placed and the VM's pass queued."""
    events = []
    monkeypatch.setattr(queue, "_send", lambda name, *args, **kwargs: events.append(name))
    sent = outbox.attempt
    monkeypatch.setattr(outbox, "attempt", lambda m: events.append(m.kind) or sent(m))
    vm, grant, job = _pool_vm_grant_and_waiting_job(scene, "k-e")
    for worker in vm.workers.all():
        WorkerSync.objects.create(worker=worker, applied_version=grant.version)
    events.clear()
    reconcile.settle_grants(vm.pk)
    assert Job.objects.get(pk=job.pk).vm_id == vm.pk
    assert events == ["tpus.tasks.advance_jobs", "access_active"]
    assert OutboxMessage.objects.get(kind="access_active").state == "sent"


def test_a_pass_that_places_on_its_own_vm_queues_no_second_pass(scene, passes):
    scene.vm.delete()
    vm = pool_vm(scene.lab, "a-free")
    other = pool_vm(scene.lab, "b-free")
    for each in (vm, other):
        Grant.objects.create(user=scene.milo, vm=each, state="active")
    for index in range(2):
        Job.objects.create(
            lab=scene.lab, user=scene.milo, accelerator_type="v4-8", host_id=f"k-o{index}",
            args=["true"],
        )  # fmt: skip
    placed = scheduler.place(scene.lab.pk, "v4-8", in_pass_of=vm.pk)
    assert {p.vm_id for p in placed} == {vm.pk, other.pk}
    # The pass placing starts its own job; the other VM's pass is queued.
    assert passes == [other.pk]


def test_a_placed_job_whose_start_in_the_reconcile_fails_is_left_to_its_vms_own_pass(
    scene, passes, monkeypatch, caplog
):
    """The run that placed the job starts it; should that start fail (the database
    went away mid-pass, say), the VM's own pass is queued for it and the run goes on
    to record what it saw."""
    vm, _, job = _pool_vm_grant_and_waiting_job(scene, "k-f")

    def broken(vm_id):
        raise DatabaseError("server closed the connection unexpectedly")

    monkeypatch.setattr(reconcile.job_engine, "advance", broken)
    reconcile._start_placed_jobs(vm.pk)
    assert passes == [vm.pk]
    assert f"starting the jobs placed on VM {vm.pk} in its reconcile failed" in caplog.text

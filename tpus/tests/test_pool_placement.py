"""The pool: a job submitted to a kind of VM ("any free v4-8") is placed by the
scheduler on a free VM of that kind its person may use, never a busy one, never one
without their grant, never another lab's; placement reads a constant number of rows
whatever the size of the lab."""

from __future__ import annotations

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tpus.models import Grant, Job, TpuVm
from tpus.services import job_engine, scheduler
from tpus.services.jobs import JobSpec, Kind, cancel_job, submit_job, submit_pool_job
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

scene = jobs_support.scene
SPEC = JobSpec(args=["python3", "train.py"])


def ready_vm(lab, name, users=(), *, accelerator_type="v4-8", **fields):
    fields.setdefault("state", TpuVm.State.READY)
    vm = make_vm(lab, name, accelerator_type=accelerator_type, **fields)
    for user in users:
        Grant.objects.create(user=user, vm=vm, state="active")
    return vm


@pytest.fixture
def passes(monkeypatch):
    """The VM passes placement queues (the tasks are not run)."""
    queued = []
    monkeypatch.setattr(scheduler.queue, "advance_jobs", queued.append)
    return queued


def pool_job(user, lab, kind="v4-8", **kind_fields):
    return submit_pool_job(user, lab, Kind(kind, **kind_fields), SPEC)


def test_a_pool_job_is_placed_on_a_free_vm_of_its_kind(scene, passes):
    scene.vm.delete()
    ready_vm(scene.lab, "big", [scene.milo], accelerator_type="v4-32")
    free = ready_vm(scene.lab, "small", [scene.milo])
    job = pool_job(scene.milo, scene.lab)
    job.refresh_from_db()
    assert job.vm_id == free.pk and job.placed_at is not None and job.state == "queued"
    assert passes == [free.pk]


def test_it_never_places_a_job_where_the_person_has_no_grant(scene, passes):
    scene.vm.delete()
    ready_vm(scene.lab, "a-theirs", [scene.ann])
    mine = ready_vm(scene.lab, "b-mine", [scene.milo])
    Job.objects.filter(pk=make_job(mine, scene.ann, "running").pk)
    job = pool_job(scene.milo, scene.lab)
    job.refresh_from_db()
    assert job.vm_id is None
    reasons = scheduler.why_they_wait(scene.lab.pk)
    assert reasons[job.pk] == "All 1 v4-8 you may use is busy; 0 jobs before yours."


def test_it_never_places_a_job_on_a_busy_vm(scene, passes):
    scene.vm.delete()
    busy = ready_vm(scene.lab, "a-busy", [scene.milo, scene.ann])
    held = ready_vm(scene.lab, "b-held", [scene.milo], outside_holders=[{"worker": 0}])
    waited_for = ready_vm(scene.lab, "c-named", [scene.milo, scene.ann])
    gone = ready_vm(scene.lab, "d-gone", [scene.milo], state=TpuVm.State.PREEMPTED)
    make_job(busy, scene.ann, "running")
    make_job(waited_for, scene.ann, "queued")
    job = pool_job(scene.milo, scene.lab)
    job.refresh_from_db()
    assert job.vm_id is None and passes == []
    assert {held.pk, gone.pk}.isdisjoint(passes)


def test_it_never_places_a_job_on_another_labs_vm(scene, cast, passes):
    scene.vm.delete()
    theirs = ready_vm(cast.other_lab, "theirs", [scene.milo])
    with pytest.raises(PermissionDenied, match="no v4-8 of Vision Lab"):
        pool_job(scene.milo, scene.lab)
    mine = ready_vm(scene.lab, "mine", [scene.milo])
    make_job(mine, scene.ann, "running")
    job = pool_job(scene.milo, scene.lab)
    assert scheduler.place(cast.other_lab.pk) == []
    assert scheduler.place(scene.lab.pk) == []
    job.refresh_from_db()
    assert job.vm_id is None and theirs.pk not in passes


def test_two_pool_jobs_on_two_free_vms_both_get_one(scene, passes):
    scene.vm.delete()
    first = ready_vm(scene.lab, "a", [scene.milo, scene.ann])
    second = ready_vm(scene.lab, "b", [scene.milo, scene.ann])
    one = pool_job(scene.milo, scene.lab)
    two = pool_job(scene.ann, scene.lab)
    three = pool_job(scene.ann, scene.lab)
    placed = dict(Job.objects.filter(pk__in=[one.pk, two.pk, three.pk]).values_list("pk", "vm_id"))
    assert placed == {one.pk: first.pk, two.pk: second.pk, three.pk: None}
    assert sorted(passes) == sorted([first.pk, second.pk])
    assert scheduler.why_they_wait(scene.lab.pk) == {
        three.pk: "All 2 v4-8 you may use are busy; 0 jobs before yours."
    }


def test_the_first_in_line_goes_first_and_a_job_that_cannot_go_lets_the_next_one(scene, passes):
    scene.vm.delete()
    vm = ready_vm(scene.lab, "a", [scene.milo, scene.ann])
    spot = ready_vm(scene.lab, "b", [scene.ann], preemptible=True)
    make_job(vm, scene.ann, "running")
    make_job(spot, scene.ann, "running")
    first = pool_job(scene.milo, scene.lab)
    second = pool_job(scene.ann, scene.lab)
    spot_only = pool_job(scene.ann, scene.lab, provisioning="spot")
    assert scheduler.why_they_wait(scene.lab.pk)[second.pk].endswith("1 job before yours.")
    Job.objects.filter(vm__in=[vm, spot]).update(state="succeeded")
    Grant.objects.filter(user=scene.milo).update(state="revoked")
    placed = scheduler.place(scene.lab.pk)
    assert {(p.job_id, p.vm_id) for p in placed} == {(second.pk, vm.pk), (spot_only.pk, spot.pk)}
    first.refresh_from_db()
    assert first.vm_id is None


def test_a_persons_chip_limit_keeps_their_next_job_waiting(scene, passes):
    scene.vm.delete()
    scene.lab.max_chips_per_person = 4
    scene.lab.save()
    a = ready_vm(scene.lab, "a", [scene.milo])
    ready_vm(scene.lab, "b", [scene.milo])
    make_job(a, scene.milo, "running")
    job = pool_job(scene.milo, scene.lab)
    job.refresh_from_db()
    assert job.vm_id is None
    assert scheduler.why_they_wait(scene.lab.pk)[job.pk] == (
        "Your running jobs hold 4 chips; this lab allows 4 at once per person. 0 jobs before yours."
    )


def test_a_pool_job_and_a_job_by_name_on_the_same_vm_do_not_collide(scene, passes):
    """The VM's place is held by one job at a time: the job named for the VM is ahead
    of the pool, and the pool job placed there waits its turn on it."""
    scene.vm.state = TpuVm.State.READY
    scene.vm.save()
    by_name = submit_job(scene.ann, scene.vm, SPEC)
    pooled = pool_job(scene.milo, scene.lab)
    pooled.refresh_from_db()
    assert pooled.vm_id is None  # the VM is waited for by name
    Job.objects.filter(pk=by_name.pk).update(state="running")
    by_name_too = submit_job(scene.ann, scene.vm, SPEC)
    Job.objects.filter(pk=by_name.pk).update(state="succeeded")
    assert scheduler.place(scene.lab.pk) == []  # the named job is next on it
    Job.objects.filter(pk=by_name_too.pk).update(state="running")
    # Two jobs of one VM can never both hold its place.
    with pytest.raises(Exception):  # noqa: B017 (the database's own constraint)
        make_job(scene.vm, scene.milo, "validating")


def test_a_pool_job_is_refused_without_access_to_any_vm_of_the_kind(scene, passes):
    with pytest.raises(PermissionDenied, match="no v4-32 of Vision Lab"):
        pool_job(scene.milo, scene.lab, "v4-32")
    with pytest.raises(ValidationError) as refused:
        submit_pool_job(scene.milo, scene.lab, Kind("v4 8", ("nowhere",), "cheap"), SPEC)
    assert set(refused.value.message_dict) == {"accelerator_type", "zones", "provisioning"}
    with pytest.raises(ValidationError) as refused:
        submit_pool_job(scene.milo, scene.lab, Kind("v4-8"), JobSpec())
    assert "args" in refused.value.message_dict
    assert not Job.objects.exists()


def test_a_pool_job_waits_within_the_labs_limit_per_kind(scene, passes):
    scene.lab.max_queued_jobs = 2
    scene.lab.save()
    pool_job(scene.milo, scene.lab)
    pool_job(scene.milo, scene.lab)
    with pytest.raises(ValidationError, match="2 job\\(s\\) waiting for a v4-8"):
        pool_job(scene.milo, scene.lab)


def test_a_waiting_pool_job_is_cancelled_at_once(scene, passes):
    job = pool_job(scene.milo, scene.lab)
    job = cancel_job(job, scene.milo)
    assert job.state == "cancelled" and job.vm_id is None and passes == []


def test_the_vms_pass_places_a_pool_job_when_the_vm_is_free(scene, passes, monkeypatch):
    """A VM whose job ended gives its place to the pool in the same pass."""
    scene.vm.state = TpuVm.State.READY
    scene.vm.save()
    running = make_job(scene.vm, scene.ann, "succeeded")
    job = pool_job(scene.milo, scene.lab)
    job.refresh_from_db()
    assert job.vm_id == scene.vm.pk  # the VM was free
    Job.objects.filter(pk=job.pk).update(vm=None, placed_at=None)
    Job.objects.filter(pk=running.pk).update(state="queued")
    begun = []
    monkeypatch.setattr(job_engine, "_begin", lambda head, *a: begun.append(head.pk))
    job_engine.advance(scene.vm.pk)
    assert begun == [running.pk]  # the job named for the VM first
    Job.objects.filter(pk=running.pk).update(state="succeeded")
    begun.clear()
    job_engine.advance(scene.vm.pk)
    assert begun == [job.pk]
    job.refresh_from_db()
    assert job.vm_id == scene.vm.pk


def test_the_job_poll_places_waiting_pool_jobs(scene, passes):
    scene.vm.state = TpuVm.State.READY
    scene.vm.save()
    make_job(scene.vm, scene.ann, "running")
    job = pool_job(scene.milo, scene.lab)
    Job.objects.filter(vm=scene.vm, user=scene.ann).update(state="succeeded")
    job_engine.poll_all()
    job.refresh_from_db()
    assert job.vm_id == scene.vm.pk and scene.vm.pk in passes
    # A pool job no VM takes waits without one: the poll visits no "VM" for it.
    passes.clear()
    pool_job(scene.milo, scene.lab)
    job_engine.poll_all()
    assert None not in passes and passes == [scene.vm.pk]


def queries_of_a_placement(lab, vms: int, jobs: int, users) -> int:
    for index in range(vms):
        vm = ready_vm(lab, f"n{vms}-{index}", users, accelerator_type=f"v{2 + index % 3}-8")
        make_job(vm, users[0], "running")
    for index in range(jobs):
        Job.objects.create(
            lab=lab,
            user=users[index % 2],
            accelerator_type=f"v{2 + index % 3}-8",
            host_id=f"q{vms}-{index}",
            args=["true"],
        )
    with CaptureQueriesContext(connection) as captured:
        scheduler.place(lab.pk)
    Job.objects.filter(lab=lab).delete()
    TpuVm.objects.filter(lab=lab).delete()
    return len(captured)


def test_placement_reads_as_many_rows_in_as_many_queries_for_any_size(scene, passes):
    users = [scene.milo, scene.ann]
    small = queries_of_a_placement(scene.lab, 2, 3, users)
    large = queries_of_a_placement(scene.lab, 30, 60, users)
    assert small == large <= 8

"""The pool and kind grants: a kind grant gives a person an account on each VM of the
kind, and placement puts their job only where that account is in force (the VM grant
active), whatever the kind grant says."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tpus.models import Grant, Job, LabAllowance, TpuVm, Worker
from tpus.services import grants as grant_services
from tpus.services import scheduler
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

"""Rows for the job pages' and API's tests: a TPU VM in the cast's lab that milo (the
cast's member) has active access to, and jobs made directly in the database in any
state, with their workers' parts."""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass

import pytest
from django.utils import timezone

from accounts.models import UnixAccount
from tpus.models import Grant, Job, JobWorker, TpuVm, Worker

_ids = itertools.count(1)
_uids = itertools.count(52000)


def account(user, username: str) -> None:
    UnixAccount.objects.update_or_create(
        user=user, defaults={"username": username, "uid": next(_uids)}
    )


def make_vm(lab, name: str = "tpu5", *, workers: int = 1, **fields) -> TpuVm:
    fields.setdefault("accelerator_type", f"v4-{8 * workers}")
    vm = TpuVm.objects.create(lab=lab, name=name, zone="us-central1-f", source="manual", **fields)
    for index in range(workers):
        # Documentation addresses: outside the test's allowed networks, so the remote
        # door refuses them before a packet is sent.
        Worker.objects.create(vm=vm, index=index, external_ip=f"192.0.2.{10 + index}")
    return vm


def make_job(vm, user, state: str = "queued", *, parts: bool | None = None, **fields) -> Job:
    """A job as the job pass would have left it in ``state``; started and ended ones
    have a part on every worker of the VM (``parts`` overrides)."""
    now = timezone.now()
    fields.setdefault("args", ["python3", "train.py", "--steps", "10"])
    if state in ("validating", "starting", "running", "cancelling"):
        fields.setdefault("begun_at", now - dt.timedelta(minutes=5))
    if state in ("running", "cancelling", "succeeded", "failed", "cancelled", "lost"):
        fields.setdefault("started_at", now - dt.timedelta(minutes=5))
    if state in ("succeeded", "failed", "cancelled", "lost", "rejected"):
        fields.setdefault("ended_at", now - dt.timedelta(minutes=1))
    job = Job.objects.create(
        vm=vm, user=user, host_id=f"20260101-t{next(_ids):06d}", state=state, **fields
    )
    if parts if parts is not None else bool(job.started_at or state == "rejected"):
        ended = job.ended_at is not None
        job.worker_count = vm.workers.count()
        job.save(update_fields=["worker_count"])
        JobWorker.objects.bulk_create(
            JobWorker(
                job=job,
                worker=worker,
                index=worker.index,
                state="ended" if ended else "running",
                pid=4000 + worker.index,
                started_at=job.started_at,
                ended_at=job.ended_at,
                exit_status=0 if ended else None,
                log_tail=f"hello from worker {worker.index}\n",
                log_size=24,
            )
            for worker in vm.workers.order_by("index")
        )
    return job


@dataclass
class Scene:
    lab: object
    vm: TpuVm
    milo: object  # the cast's member: active access to the VM
    ann: object  # another member with active access to the VM
    admin: object


@pytest.fixture
def scene(cast, make_user, add_member) -> Scene:
    vm = make_vm(cast.lab)
    ann = make_user("ann@vision.example")
    add_member(cast.lab, ann)
    account(cast.member, "milo")
    account(ann, "ann")
    account(cast.admin, "boss")
    for user in (cast.member, ann):
        Grant.objects.create(user=user, vm=vm, state="active")
    return Scene(cast.lab, vm, cast.member, ann, cast.admin)

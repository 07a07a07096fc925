"""An elastic pool on real hosts: a job for any v4-8 submitted while the lab has none
waits; the pool asks Google for one, the emulator makes it of a fleet host, it joins
the lab connected and pinned, the person's kind grant gives them an account there, and
the job runs on it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.utils import timezone

from accounts.unix import choose_username
from portal import outbox
from testfleet.guestagent import offer_hosts
from tests.requirements import need
from tpus.models import AuditAction, AuditEvent, Grant, Job, LabAllowance, VmConnection, VmRequest
from tpus.services import connect, elastic_admin, job_engine, vm_request_work
from tpus.services.jobs import JobSpec, Kind, submit_pool_job
from tpus.services.kind_grants import grant_kind
from tpus.tasks import reconcile_vm as reconcile_task
from tpus.tests.test_jobs_host import JAX_ENV
from tpus.tests.test_remote_kept_connections import _wait_for
from tpus.tests.test_remote_transport import logins

pytestmark = pytest.mark.fleet

PROJECT = "vision-project"
ZONE = "us-central2-b"
ADVANCE = "tpus.tasks.advance_jobs"


def test_a_job_waiting_on_an_empty_elastic_pool_runs_on_the_vm_the_pool_made(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, guest_agent, cast, settings,
    fleet_username, fleet_uids, django_capture_on_commit_callbacks, queued_tasks, monkeypatch,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    settings.PORTAL_CONNECT_WAIT_SECONDS = 30
    settings.PORTAL_CONNECT_POLL_SECONDS = 0.3
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=8)
    [host] = fleet_hosts(1)
    # The home the portal makes has ~/venv, from the host's skeleton.
    fleet.exec(host.name, ["sh", "-c", f"mkdir -p /etc/skel && ln -sfn {JAX_ENV} /etc/skel/venv"])
    offer_hosts(fleet, tpu_emulator.controls.store, [host.name])
    choose_username(cast.member, fleet_username)
    milo = type(cast.member).objects.select_related("unix_account").get(pk=cast.member.pk)
    grant_kind(cast.admin, lab, milo, "v4-8", sudo=False)
    elastic_admin.set_pool(
        cast.admin, lab, "v4-8", enabled=True, zones=[ZONE], runtime_version="tpu-ubuntu2204-base"
    )
    spec = JobSpec(args=["python", "-c", "import time; time.sleep(60)"], python="~/venv")
    with django_capture_on_commit_callbacks(execute=True):
        job = submit_pool_job(milo, lab, Kind("v4-8"), spec)
    # The submit's look at the pool asked for one VM, and its call went to Google.
    made = VmRequest.objects.get(lab=lab, elastic_pool__isnull=False)
    deadline = time.monotonic() + 60
    while made.state != "ready" and time.monotonic() < deadline:
        with django_capture_on_commit_callbacks(execute=True):
            vm_request_work.send(made.pk)
        made.refresh_from_db()
        time.sleep(0.2)
    assert made.state == "ready", made.error
    vm = made.vm
    assert (vm.accelerator_type, vm.preemptible) == ("v4-8", True)
    connection = VmConnection.objects.get(vm=vm)
    while connection.state == "connecting" and time.monotonic() < deadline:
        with django_capture_on_commit_callbacks(execute=True):
            connect.check_connection(connection.pk, connection.attempt, connection.checks)
        connection.refresh_from_db()
        if connection.next_check_at is not None:
            time.sleep(max(0.0, (connection.next_check_at - timezone.now()).total_seconds()))
    assert connection.state == "connected"
    # The kind grant gave milo an account on the new VM; its reconcile puts it in force,
    # places the waiting job there in the same settle and starts it, over the login it
    # has just used; the "You can now use" email goes out after the start.
    sent, attempt = [], outbox.attempt
    monkeypatch.setattr(
        outbox,
        "attempt",
        lambda m: sent.append((m.kind, Job.objects.get(pk=job.pk).state)) or attempt(m),
    )
    before = logins(fleet, host)
    queued_tasks.take(ADVANCE)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            reconcile_task.apply((vm.pk,))
        grant = Grant.objects.get(vm=vm, user=milo)
        assert grant.state == "active" and grant.from_kind_id is not None
        job.refresh_from_db()
        assert job.vm_id == vm.pk and job.placed_at >= grant.activated_at
        assert job.state == "running", job.reason
        # Started before the run recorded the rest of what it saw (its audit row last).
        ran = AuditEvent.objects.filter(action=AuditAction.VM_RECONCILED, data__vm=vm.pk)
        assert job.started_at <= ran.latest("created_at").created_at
        assert queued_tasks.take(ADVANCE) == []  # no pass of its own was needed
        assert sent == [("access_active", "running")]
        _wait_for(lambda: logins(fleet, host) > before, 5, "sshd's log line")
        time.sleep(0.3)  # a second login would be logged by now
        assert logins(fleet, host) - before == 1
    finally:
        for running in Job.objects.filter(state__in=["running", "cancelling", "starting"]):
            job_engine.stop_on_workers(running, grace=0)

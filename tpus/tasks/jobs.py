"""Jobs: a pass over one VM's queue, the periodic poll (which also keeps the per-day
usage rows), and who holds a VM's chips (on a schedule, and for an open VM page)."""

from __future__ import annotations

from django.conf import settings

from portal.celery import every
from tpus.models import TpuVm
from tpus.services import holders, idle_holders, job_engine, usage
from tpus.tasks.naming import task


@task(ignore_result=True)
def advance_jobs(vm_id: int) -> None:
    """Poll the VM's running job and start the next one in line."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        job_engine.advance(vm_id)


@every(settings.PORTAL_JOB_POLL_SECONDS, name="poll-jobs")
@task(ignore_result=True)
def poll_jobs() -> None:
    """Every VM with a job running or waiting gets a pass of its own; jobs that ended
    are added to the per-day usage rows."""
    job_engine.poll_all()
    usage.count_ended_jobs()


@task(ignore_result=True)
def check_tpu_usage(vm_id: int) -> None:
    """Who holds the VM's chips now, for its page and the lab's usage page."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        job_engine.check_usage(vm_id)


@every(settings.PORTAL_HOLDER_PASS_SECONDS, name="look-at-idle-chips")
@task(ignore_result=True)
def look_at_idle_chips() -> None:
    """Queue a look at who holds the chips of a few VMs no job holds, least recently
    looked at first (PORTAL_HOLDER_PASS_VMS a run)."""
    holders.look_at_idle_vms()


@every(settings.PORTAL_IDLE_PASS_SECONDS, name="idle-holders")
@task(ignore_result=True)
def follow_idle_holders() -> None:
    """The labs' policy on idle chips: read the kept chip samples of up to
    PORTAL_IDLE_PASS_VMS held VMs, tell holders and admins, release when due."""
    idle_holders.run_pass()

"""Jobs: a pass over one VM's queue, the periodic poll, and who holds a VM's chips."""

from __future__ import annotations

from django.conf import settings

from portal.celery import every
from tpus.models import TpuVm
from tpus.services import job_engine
from tpus.tasks.naming import task


@task(ignore_result=True)
def advance_jobs(vm_id: int) -> None:
    """Poll the VM's running job and start the next one in line."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        job_engine.advance(vm_id)


@every(settings.PORTAL_JOB_POLL_SECONDS, name="poll-jobs")
@task(ignore_result=True)
def poll_jobs() -> None:
    """Every VM with a job running or waiting gets a pass of its own."""
    job_engine.poll_all()


@task(ignore_result=True)
def check_tpu_usage(vm_id: int) -> None:
    """Who holds the VM's chips now, for its page and the lab's usage page."""
    if TpuVm.objects.filter(pk=vm_id).exists():
        job_engine.check_usage(vm_id)

"""TPU VMs the portal makes: the call behind a request, the pass that follows the
requests still open until their VM is up (or they failed or were cancelled), and a
VM's stop, start or deletion."""

from __future__ import annotations

from django.conf import settings

from portal.celery import every
from tpus.models import VmRequest
from tpus.services import elastic_pass, vm_lifecycle, vm_request_work
from tpus.tasks.naming import task


@task(ignore_result=True)
def send_vm_request(request_id: int) -> None:
    """Ask Google Cloud for the VM (once), or look how the request goes."""
    if VmRequest.objects.filter(pk=request_id).exists():
        vm_request_work.send(request_id)


@every(settings.PORTAL_VM_REQUEST_POLL_SECONDS, name="follow-vm-requests")
@task(ignore_result=True)
def follow_vm_requests() -> None:
    """Every open request gets a look of its own."""
    vm_request_work.follow_open()


@task(bind=True, ignore_result=True, max_retries=None)
def change_vm(self, vm_id: int, action: str) -> None:
    """Ask Google Cloud to stop, start or delete a VM (the look at how it goes is a
    task of its own, ``follow_vm_change``); a stop or delete looks again a little later
    while the jobs it cancelled still end (bounded by ``vm_lifecycle.stop_wait``). Run
    in-process, it cannot wait: it goes ahead."""
    if action not in (vm_lifecycle.STOP, vm_lifecycle.START, vm_lifecycle.DELETE):
        return
    again = vm_lifecycle.run(vm_id, action, may_wait=not self.request.is_eager)
    if again is not None:
        raise self.retry(countdown=again)


@task(ignore_result=True)
def follow_vm_change(change_id: int) -> None:
    """One look at a VM's stop, start or deletion underway at Google."""
    vm_lifecycle.follow(change_id)


@task(ignore_result=True)
def check_elastic_pool(lab_id: int, accelerator_type: str) -> None:
    """Grow the kind's elastic pool for the jobs no VM takes, and let go of its idle VMs."""
    elastic_pass.check_kind(lab_id, accelerator_type)


@every(settings.PORTAL_ELASTIC_POOL_SECONDS, name="elastic-pools")
@task(ignore_result=True)
def elastic_pools() -> None:
    """Every elastic pool: grown for waiting jobs, its VMs idle past the limit deleted."""
    elastic_pass.run_all()

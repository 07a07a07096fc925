"""VMs kept alive: one that Google preempted, terminated or deleted is asked for again
as a queued request of the same name, type, version and kind, and when it is back the
portal restores what it had (accounts, disks, the jobs its people asked to run again).

Asking again is checked like any request (the lab's allowance, its grant's end, with
the lab locked). A refused VM stays down: its request keeps the keep-alive duty and
says why (``kept_down``, shown on the VM's page), the lab's admins are told once, and
every pass checks again, so it is asked for by itself once the chips are free (another
VM stopped or deleted, the allowance raised, the grant's end moved).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from portal import audit
from tpus import queue
from tpus.cloud.config import cloud_tpu
from tpus.cloud.operations import gone_is_done
from tpus.models import AuditAction, TpuVm
from tpus.models.inventory import AttachmentState, DiskAttachment, NodeState
from tpus.models.provisioning import VmRequest, VmRequestState
from tpus.services import allowances, emails

# Node states in which Google took a VM back (a stopped VM was stopped by the lab).
TAKEN_BACK = {NodeState.PREEMPTED, NodeState.TERMINATED}


def bring_back() -> list[VmRequest]:
    """Each VM kept alive that Google preempted, terminated or deleted gets a new
    queued request of the same name, type, version and kind (its own row, by the
    portal), when the lab's allowance and grant allow it (``kept_down`` otherwise).
    When it is up, ``_arrived`` restores everything on it."""
    taken_back = Q(vm__state__in=TAKEN_BACK) | Q(vm__missing_since__isnull=False)
    duties = VmRequest.objects.filter(state=VmRequestState.READY, keep_alive=True, vm__isnull=False)
    # Back by other means meanwhile (Google's own restart): no longer kept down.
    duties.filter(kept_down_since__isnull=False).exclude(taken_back).update(
        kept_down="", kept_down_since=None
    )
    gone = duties.filter(taken_back).select_related("vm", "lab")
    revived = []
    for old in gone:
        with transaction.atomic():
            # Checked with the lab locked, as a request of the lab's admins is; the VM
            # holds nothing while Google has it, so it does not count against itself.
            try:
                allowances.claim(old.lab, old.accelerator_type, old.provisioning)
            except ValidationError as exc:
                kept_down(old, exc.messages[0])
                continue
            # The keep-alive duty moves to the new request, so the next pass skips this one.
            if not VmRequest.objects.filter(pk=old.pk, keep_alive=True).update(
                keep_alive=False, kept_down="", kept_down_since=None
            ):
                continue
            try:
                with transaction.atomic():
                    again = VmRequest.objects.create(
                        lab=old.lab,
                        name=old.name,
                        zone=old.zone,
                        accelerator_type=old.accelerator_type,
                        runtime_version=old.runtime_version,
                        provisioning=old.provisioning,
                        queued=True,
                        keep_alive=True,
                        vm=old.vm,
                    )
            except IntegrityError:  # someone asked for that name already
                continue
            why = "deleted" if old.vm.missing_since else old.vm.get_state_display().lower()
            audit.record(
                AuditAction.VM_REQUESTED,
                lab=old.lab,
                summary=f"{old.name} in {old.zone} again: it was {why} and is kept alive",
                data={"request": again.pk, "after": old.pk, "vm": old.vm_id},
            )
            queue.send_vm_request(again.pk)
        run_again_what_it_lost(again)
        revived.append(again)
    return revived


def held_down(vm: TpuVm) -> VmRequest | None:
    """The request whose kept-alive VM the portal has not asked for again (and why),
    if ``vm`` is one."""
    return VmRequest.objects.filter(vm=vm, keep_alive=True, kept_down_since__isnull=False).first()


def kept_down(old: VmRequest, why: str) -> None:
    """The kept-alive VM of ``old`` is not asked for again, for ``why``: the request
    keeps its duty and shows why; the first refusal of a spell is audited and emailed
    to the lab's admins (claimed by setting ``kept_down_since``), later passes only
    bring the reason up to date."""
    first = VmRequest.objects.filter(
        pk=old.pk, keep_alive=True, kept_down_since__isnull=True
    ).update(kept_down=why, kept_down_since=timezone.now())
    if not first:
        VmRequest.objects.filter(pk=old.pk, keep_alive=True).exclude(kept_down=why).update(
            kept_down=why
        )
        return
    audit.record(
        AuditAction.VM_KEPT_DOWN,
        lab=old.lab,
        summary=f"{old.name} in {old.zone} stays down: {why}",
        data={"request": old.pk, "vm": old.vm_id},
    )
    emails.send_vm_kept_down(old.pk)


def run_again_what_it_lost(made: VmRequest) -> None:
    """Jobs lost in the VM's last life whose owners asked for it are queued again. The
    job pass does so when it sees the VM gone or made anew; a job it ended as lost
    before the sync saw the preemption is caught here, when the VM is asked for again
    and once more when it is back (``made`` is either request)."""
    from tpus.models import Job
    from tpus.models.jobs import JobState
    from tpus.services.jobs import run_again_after_preemption

    lost = Job.objects.filter(
        vm_id=made.vm_id, state=JobState.LOST, rerun_after_preemption=True, reruns__isnull=True
    )
    last_life = (
        VmRequest.objects.filter(vm_id=made.vm_id, ready_at__isnull=False)
        .exclude(pk=made.pk)
        .order_by("-ready_at")
        .values_list("ready_at", flat=True)
        .first()
    )
    if last_life:
        lost = lost.filter(ended_at__gte=last_life)
    for job in lost.select_related("vm__lab", "user__unix_account").order_by("queued_at"):
        run_again_after_preemption(job)


def disks_to_carry(made: VmRequest) -> list[tuple[str, str]]:
    """``(source disk, mode)`` of each disk the VM had attached (not being detached)
    when it is asked for again, for the new node to be made with: Google's new node
    has only the disks its request names."""
    if made.vm_id is None:
        return []
    attached = (
        DiskAttachment.objects.filter(vm_id=made.vm_id, state=AttachmentState.ATTACHED)
        .select_related("disk")
        .order_by("attached_at", "pk")
    )
    project = made.lab.gcp_project_id
    return [
        (f"projects/{project}/zones/{a.disk.zone}/disks/{a.disk.name}", a.mode) for a in attached
    ]


def clear_leftovers(made: VmRequest) -> tuple[str, str] | None:
    """Before a kept-alive VM is asked for again: what Google still has of its last
    life (the preempted node, a suspended or failed queued resource of it) is deleted,
    or the new request could not take the name. Each deletion is sent without waiting:
    the first Google is still on is returned (its operation and call) for the request
    to look at later; None once nothing is left."""
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    for info in client.list_queued_resources(project, made.zone):
        if info.node_id == made.name and info.name != made.cloud_id:
            started = gone_is_done(
                lambda name=info.name: client.begin_delete_queued_resource(
                    project, made.zone, name, with_node=True
                )
            )
            if not started.done:
                return started.operation, "DeleteQueuedResource"
    started = gone_is_done(lambda: client.begin_delete_node(project, made.zone, made.name))
    return None if started.done else (started.operation, "DeleteNode")

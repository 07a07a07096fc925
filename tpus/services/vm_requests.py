"""TPU VMs a lab admin asks the portal to make: checked before any call, made directly
(``CreateNode``) or queued until Google has capacity (a queued resource), followed until
the node is up, then registered in the lab already connected: the lab's key line is in
the node's ``ssh-keys`` metadata from its creation, its host keys are pinned from its
guest attributes, and the usual connection check confirms every worker takes the key.

A request is a ``VmRequest`` row. ``request_vm`` stores it and queues ``send``; a
queued one is then followed by ``follow`` (the ``follow-vm-requests`` pass every
``PORTAL_VM_REQUEST_POLL_SECONDS``) until it is up, failed or cancelled.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from portal import audit
from tpus import access, queue
from tpus.cloud import CloudError, NodeInfo, NodeRequest
from tpus.cloud.config import cloud_tpu
from tpus.cloud.sshkeys import KeyLine
from tpus.models import AuditAction, Lab, TpuVm, Worker
from tpus.models.inventory import HostKeySource, NodeState, validate_node_name
from tpus.models.provisioning import (
    OPEN_REQUEST_STATES,
    LabAllowance,
    LabNotice,
    Provisioning,
    VmRequest,
    VmRequestState,
    chips_of,
)
from tpus.services import connect, emails, inventory, leases
from tpus.services.labkeys import lab_key

log = logging.getLogger(__name__)

# How long past its window's end a request may still be waiting at Google before the
# portal cancels it there itself.
WINDOW_GRACE = dt.timedelta(minutes=5)
# Node states in which Google took a VM back (a stopped VM was stopped by the lab).
TAKEN_BACK = {NodeState.PREEMPTED, NodeState.TERMINATED}
# Node states in which a VM holds none of the lab's allowance.
NOT_HOLDING = {NodeState.PREEMPTED, NodeState.TERMINATED, NodeState.STOPPED}


@dataclass(frozen=True)
class VmSpec:
    """What the admin's form or API call asks for."""

    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    provisioning: str = Provisioning.ON_DEMAND
    queued: bool = False
    valid_after: dt.datetime | None = None
    valid_until: dt.datetime | None = None
    keep_alive: bool = False


# --- what a lab holds ----------------------------------------------------------------


def holding(lab: Lab, generation: str, provisioning: str) -> int:
    """Chips of a generation and kind the lab holds or has asked for now: its VMs that
    are up (or coming up) and its open requests."""
    spot_like = provisioning != Provisioning.ON_DEMAND
    used = 0
    for accelerator_type, preemptible in (
        TpuVm.objects.filter(lab=lab, missing_since__isnull=True)
        .exclude(state__in=NOT_HOLDING)
        .exclude(requests__state__in=OPEN_REQUEST_STATES)  # counted as a request below
        .values_list("accelerator_type", "preemptible")
    ):
        kind_matches = preemptible if spot_like else not preemptible
        found, chips = chips_of(accelerator_type)
        if found == generation and kind_matches:
            used += chips
    for accelerator_type in VmRequest.objects.filter(
        lab=lab, provisioning=provisioning, state__in=OPEN_REQUEST_STATES
    ).values_list("accelerator_type", flat=True):
        found, chips = chips_of(accelerator_type)
        if found == generation:
            used += chips
    return used


def check_allowance(lab: Lab, accelerator_type: str, provisioning: str) -> None:
    """ValidationError with the numbers when one more VM of this type and kind would
    take the lab past its allowance (or past its grant's end)."""
    if lab.grant_end_date and timezone.localdate() > lab.grant_end_date:
        raise ValidationError(
            f"The lab's TPU grant ended on {lab.grant_end_date:%-d %B %Y}; no VM can be made."
        )
    generation, chips = chips_of(accelerator_type)
    kind = Provisioning(provisioning).label.lower()
    allowance = LabAllowance.objects.filter(
        lab=lab, generation=generation, provisioning=provisioning
    ).first()
    if allowance is None:
        raise ValidationError(
            f"The lab has no allowance for {kind} {generation} chips; a site admin sets the "
            "lab's allowance from its TPU grant."
        )
    used = holding(lab, generation, provisioning)
    if used + chips > allowance.chips:
        raise ValidationError(
            f"A {accelerator_type} is {chips} {generation} chips; the lab holds {used} {kind} "
            f"{generation} chips of its {allowance.chips}, so {allowance.chips - used} are left."
        )


@dataclass(frozen=True)
class AllowanceUse:
    """One allowance, the chips the lab holds against it now, and the day it ends (the
    lab's TPU grant's end) with the days left counted from ``today``: 0 on its last
    day, below 0 once it has ended."""

    generation: str
    provisioning: str
    chips: int
    used: int
    ends_on: dt.date | None = None
    days_left: int | None = None

    @property
    def left(self) -> int:
        return max(0, self.chips - self.used)

    @property
    def ended(self) -> bool:
        return self.days_left is not None and self.days_left < 0


def allowance_use(lab: Lab, today: dt.date | None = None) -> list[AllowanceUse]:
    """Each of the lab's allowances with the chips it holds against it now."""
    today = today or timezone.localdate()
    ends_on = lab.grant_end_date
    days_left = (ends_on - today).days if ends_on else None
    return [
        AllowanceUse(
            a.generation,
            a.provisioning,
            a.chips,
            holding(lab, a.generation, a.provisioning),
            ends_on,
            days_left,
        )
        for a in LabAllowance.objects.filter(lab=lab)
    ]


ALLOWANCE_SITE_ADMIN_ONLY = (
    "Only a site admin sets what a lab may hold: it comes from the lab's TPU grant."
)
GENERATIONS = ("v2", "v3", "v4", "v5litepod", "v5p", "v6e")


def set_allowance(
    site_admin, lab: Lab, generation: str, provisioning: str, chips: int, *, request=None
):
    """How many chips of a generation and kind the lab may hold at once; 0 removes the
    allowance. Site admins only (it is what the lab's TPU grant says)."""
    if not getattr(site_admin, "is_site_admin", False):
        raise PermissionDenied(ALLOWANCE_SITE_ADMIN_ONLY)
    errors = {}
    if generation not in GENERATIONS:
        errors["generation"] = [f"Choose one of {', '.join(GENERATIONS)}."]
    if provisioning not in Provisioning.values:
        errors["provisioning"] = ["Choose on-demand, spot or preemptible."]
    if not isinstance(chips, int) or not 0 <= chips <= 100_000:
        errors["chips"] = ["A number of chips, 0 to 100000 (0 removes the allowance)."]
    if errors:
        raise ValidationError(errors)
    with transaction.atomic():
        if chips == 0:
            LabAllowance.objects.filter(
                lab=lab, generation=generation, provisioning=provisioning
            ).delete()
        else:
            LabAllowance.objects.update_or_create(
                lab=lab, generation=generation, provisioning=provisioning, defaults={"chips": chips}
            )
        audit.record(
            AuditAction.ALLOWANCE_SET,
            actor=site_admin,
            lab=lab,
            summary=f"{chips} {provisioning} {generation} chips"
            if chips
            else f"no {provisioning} {generation} chips",
            data={"generation": generation, "provisioning": provisioning, "chips": chips},
            request=request,
        )


@dataclass(frozen=True)
class Offered:
    """What each of the lab's zones offers, as the API lists it, and the zones that
    could not be read (with why)."""

    zones: dict[str, dict[str, list[str]]]
    errors: dict[str, str]


def offered(lab: Lab) -> Offered:
    zones, errors = {}, {}
    if not lab.gcp_project_id:
        return Offered({}, {})
    client = cloud_tpu()
    for zone in lab.zones:
        try:
            zones[zone] = {
                "types": client.accelerator_types(lab.gcp_project_id, zone),
                "versions": client.runtime_versions(lab.gcp_project_id, zone),
            }
        except CloudError as exc:
            errors[zone] = str(exc)
    return Offered(zones, errors)


# --- asking ---------------------------------------------------------------------------


def check_spec(lab: Lab, spec: VmSpec) -> VmSpec:
    """The spec, or ValidationError naming each bad field. Asks the API what the zone
    offers (types and versions); a refused spec has made no other call."""
    errors: dict[str, list[str]] = {}

    def add(field: str, message: str) -> None:
        errors.setdefault(field, []).append(message)

    name = spec.name.strip()
    try:
        validate_node_name(name)
    except ValidationError as exc:
        add("name", exc.messages[0])
    if spec.zone not in lab.zones:
        add("zone", f"Choose one of the lab's zones: {', '.join(lab.zones) or 'none yet'}.")
    if spec.provisioning not in Provisioning.values:
        add("provisioning", "Choose on-demand, spot or preemptible.")
    now = timezone.now()
    if not spec.queued and (spec.valid_after or spec.valid_until):
        add("valid_until", "A start or end time applies to a queued request only.")
    if spec.valid_until and spec.valid_until <= now:
        add("valid_until", "The end of the window is in the past.")
    if spec.valid_after and spec.valid_until and spec.valid_until <= spec.valid_after:
        add("valid_until", "The window ends before it starts.")
    if not errors:
        if TpuVm.objects.filter(lab=lab, zone=spec.zone, name=name).exists():
            add("name", f"The lab already has a TPU VM named {name} in {spec.zone}.")
        elif VmRequest.objects.filter(
            lab=lab, zone=spec.zone, name=name, state__in=OPEN_REQUEST_STATES
        ).exists():
            add("name", f"A request for {name} in {spec.zone} is already under way.")
    if not errors:
        try:
            _check_offered(lab, spec, add)
        except CloudError as exc:
            add("zone", f"The Cloud TPU API could not say what {spec.zone} offers: {exc}")
    if not errors:
        try:
            check_allowance(lab, spec.accelerator_type, spec.provisioning)
        except ValidationError as exc:
            add("accelerator_type", exc.messages[0])
    if errors:
        raise ValidationError(errors)
    return VmSpec(**{**spec.__dict__, "name": name})


def _check_offered(lab: Lab, spec: VmSpec, add) -> None:
    client = cloud_tpu()
    types = client.accelerator_types(lab.gcp_project_id, spec.zone)
    if spec.accelerator_type not in types:
        add("accelerator_type", f"{spec.zone} offers {', '.join(types) or 'no TPU types'}.")
    versions = client.runtime_versions(lab.gcp_project_id, spec.zone)
    if spec.runtime_version not in versions:
        add(
            "runtime_version",
            f"{spec.zone} has no runtime version {spec.runtime_version}; it has "
            f"{', '.join(versions) or 'none'}.",
        )


def request_vm(admin, lab: Lab, spec: VmSpec, *, request=None) -> VmRequest:
    """Ask for a TPU VM for ``lab``. Raises PermissionDenied for a non-admin and
    ValidationError (nothing stored, nothing asked of Google) for a bad spec."""
    if not access.is_lab_admin(admin, lab):
        raise PermissionDenied("Only the lab's admins can make TPU VMs.")
    if not lab.gcp_project_id:
        raise ValidationError("The lab has no GCP project yet; a site admin sets it.")
    spec = check_spec(lab, spec)
    try:
        with transaction.atomic():
            made = VmRequest.objects.create(
                lab=lab,
                requested_by=admin,
                **spec.__dict__,
            )
            audit.record(
                AuditAction.VM_REQUESTED,
                actor=admin,
                lab=lab,
                summary=f"{made.name} in {made.zone}: {made.accelerator_type} "
                f"{made.get_provisioning_display().lower()}"
                + (", queued" if made.queued else "")
                + (", kept alive" if made.keep_alive else ""),
                data={"request": made.pk},
                request=request,
            )
            queue.send_vm_request(made.pk)
    except IntegrityError:  # the same name asked for at the same moment
        raise ValidationError(
            {"name": [f"A request for {spec.name} in {spec.zone} is already under way."]}
        ) from None
    return made


def retry_request(admin, made: VmRequest, *, request=None) -> VmRequest:
    """Ask again for what a failed or cancelled request asked for: a new request of
    the same name, zone, type, version and kind, checked like a new one (the allowance
    and the name as they are now). A window already over is dropped, one still ahead
    is kept. Raises ValidationError for a request that is open or up."""
    if not access.is_lab_admin(admin, made.lab):
        raise PermissionDenied("Only the lab's admins can make TPU VMs.")
    made = VmRequest.objects.select_related("lab").get(pk=made.pk)
    if made.state not in (VmRequestState.FAILED, VmRequestState.CANCELLED):
        raise ValidationError(
            f"Only a failed or cancelled request can be tried again; this one is "
            f"{made.get_state_display().lower()}."
        )
    now = timezone.now()
    window_over = made.valid_until is not None and made.valid_until <= now
    spec = VmSpec(
        name=made.name,
        zone=made.zone,
        accelerator_type=made.accelerator_type,
        runtime_version=made.runtime_version,
        provisioning=made.provisioning,
        queued=made.queued,
        valid_after=None if window_over else made.valid_after,
        valid_until=None if window_over else made.valid_until,
        keep_alive=made.keep_alive,
    )
    return request_vm(admin, made.lab, spec, request=request)


def cancel_request(admin, made: VmRequest, *, request=None) -> VmRequest:
    """Stop waiting for a VM: the queued resource is deleted at Google (a node it made
    meanwhile goes with it). A request that is up or over is left as it is."""
    if not access.is_lab_admin(admin, made.lab):
        raise PermissionDenied("Only the lab's admins can cancel a TPU VM request.")
    made = VmRequest.objects.select_related("lab").get(pk=made.pk)
    if not made.is_open:
        return made
    if made.cloud_id:
        try:
            cloud_tpu().delete_queued_resource(
                made.lab.gcp_project_id, made.zone, made.cloud_id, with_node=True
            )
        except CloudError as exc:
            if exc.code != "NOT_FOUND":
                raise ValidationError(f"Google Cloud did not cancel the request: {exc}") from exc
    with transaction.atomic():
        updated = VmRequest.objects.filter(pk=made.pk, state__in=OPEN_REQUEST_STATES).update(
            state=VmRequestState.CANCELLED, changed_at=timezone.now()
        )
        if updated:
            audit.record(
                AuditAction.VM_REQUEST_CANCELLED,
                actor=admin,
                lab=made.lab,
                summary=f"{made.name} in {made.zone}",
                data={"request": made.pk},
                request=request,
            )
    made.refresh_from_db()
    return made


# --- the work behind a request --------------------------------------------------------


def _claim(request_id: int) -> bool:
    now = timezone.now()
    return bool(
        VmRequest.objects.filter(pk=request_id, state__in=OPEN_REQUEST_STATES)
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .update(claimed_until=now + leases.length())
    )


def _release(request_id: int) -> None:
    VmRequest.objects.filter(pk=request_id).update(claimed_until=None)


def key_metadata(lab: Lab) -> dict[str, str]:
    """The node's metadata at creation: the lab's key line, as Connect would add it."""
    return {"ssh-keys": KeyLine(settings.PORTAL_LAB_SSH_USER, lab_key(lab).public_line).text}


def send(request_id: int) -> None:
    """Make the call a stored request stands for (once), then follow it."""
    if not _claim(request_id):
        return
    try:
        made = VmRequest.objects.select_related("lab").get(pk=request_id)
        if made.state == VmRequestState.REQUESTED:
            _send(made)
        else:
            _follow(made)
    finally:
        _release(request_id)


def _wanted(made: VmRequest) -> NodeRequest:
    return NodeRequest(
        name=made.name,
        zone=made.zone,
        accelerator_type=made.accelerator_type,
        runtime_version=made.runtime_version,
        provisioning=made.provisioning,
        metadata=key_metadata(made.lab),
        valid_after=made.valid_after,
        valid_until=made.valid_until,
    )


def _send(made: VmRequest) -> None:
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    now = timezone.now()
    try:
        if made.vm_id is not None:
            _clear_leftovers(made)
        elif made.queued:
            _clear_failed_requests(made)
        if made.queued:
            cloud_id = made.cloud_id or f"{made.name}-{made.pk}"
            # Recorded before the call: a worker that dies after it never asks twice.
            VmRequest.objects.filter(pk=made.pk).update(cloud_id=cloud_id)
            made.cloud_id = cloud_id
            try:
                client.create_queued_resource(project, cloud_id, _wanted(made))
            except CloudError as exc:
                if exc.code != "ALREADY_EXISTS":
                    raise
            _set(made, VmRequestState.WAITING, sent_at=now, waiting_since=now)
            _follow(made)
            return
        node = client.create_node(project, _wanted(made))
    except CloudError as exc:
        if exc.code == "RESOURCE_EXHAUSTED" and not made.queued:
            _fail(
                made,
                exc.code,
                f"Google Cloud has no {made.accelerator_type} capacity in {made.zone} now. "
                "Ask again as a queued request, which waits until capacity comes.",
            )
        elif exc.retryable:
            log.warning("request %s: %s; the pass tries again", made.pk, exc)
        else:
            _fail(made, exc.code, str(exc))
        return
    _set(made, VmRequestState.PROVISIONING, sent_at=now)
    _arrived(made, node)


def follow_open() -> int:
    """The periodic pass: VMs kept alive that Google took back are asked for again,
    then every open request gets a look."""
    bring_back()
    ids = list(VmRequest.objects.filter(state__in=OPEN_REQUEST_STATES).values_list("pk", flat=True))
    for request_id in ids:
        queue.send_vm_request(request_id)
    return len(ids)


# --- keep alive -----------------------------------------------------------------------


def bring_back() -> list[VmRequest]:
    """Each VM kept alive that Google preempted, terminated or deleted gets a new
    queued request of the same name, type, version and kind (its own row, by the
    portal). When it is up, ``_arrived`` restores everything on it."""
    gone = (
        VmRequest.objects.filter(state=VmRequestState.READY, keep_alive=True, vm__isnull=False)
        .filter(Q(vm__state__in=TAKEN_BACK) | Q(vm__missing_since__isnull=False))
        .select_related("vm", "lab")
    )
    revived = []
    for old in gone:
        with transaction.atomic():
            # The keep-alive duty moves to the new request, so the next pass skips this one.
            if not VmRequest.objects.filter(pk=old.pk, keep_alive=True).update(keep_alive=False):
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
        _run_again_what_it_lost(again)
        revived.append(again)
    return revived


def _run_again_what_it_lost(made: VmRequest) -> None:
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


def _clear_leftovers(made: VmRequest) -> None:
    """Before a kept-alive VM is asked for again: what Google still has of its last
    life (the preempted node, a suspended or failed queued resource of it) is deleted,
    or the new request could not take the name."""
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    for info in client.list_queued_resources(project, made.zone):
        if info.node_id == made.name and info.name != made.cloud_id:
            client.delete_queued_resource(project, made.zone, info.name, with_node=True)
    try:
        client.delete_node(project, made.zone, made.name)
    except CloudError as exc:
        if exc.code != "NOT_FOUND":
            raise


def _clear_failed_requests(made: VmRequest) -> None:
    """Before a request is sent again (tried again after it failed or was cancelled):
    a failed or suspended queued resource of the same node name, which Google keeps
    until it is deleted, would hold the name. Nothing that holds a node is touched."""
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    for info in client.list_queued_resources(project, made.zone):
        if info.node_id == made.name and info.state in ("FAILED", "SUSPENDED"):
            client.delete_queued_resource(project, made.zone, info.name, with_node=False)


def _follow(made: VmRequest) -> None:
    client = cloud_tpu()
    project = made.lab.gcp_project_id
    if made.queued and made.cloud_id:
        try:
            info = client.get_queued_resource(project, made.zone, made.cloud_id)
        except CloudError as exc:
            if exc.code == "NOT_FOUND":
                _fail(made, exc.code, "Google Cloud no longer knows the request (deleted?).")
            else:
                log.warning("request %s: %s", made.pk, exc)
            return
        if info.state == "FAILED":
            _fail(made, info.error_code, _failure_text(made, info.error_code, info.error_message))
            return
        if info.state in ("ACCEPTED", "WAITING_FOR_RESOURCES", "CREATING"):
            if made.valid_until and timezone.now() > made.valid_until + WINDOW_GRACE:
                # Google should have failed it by now; nothing waits forever unseen.
                client.delete_queued_resource(project, made.zone, made.cloud_id, with_node=True)
                _fail(made, "DEADLINE_EXCEEDED", _failure_text(made, "DEADLINE_EXCEEDED", ""))
            return
    try:
        node = client.get_node(project, made.zone, made.name)
    except CloudError as exc:
        if exc.code != "NOT_FOUND":
            log.warning("request %s: %s", made.pk, exc)
        return
    if made.state == VmRequestState.WAITING:
        _set(made, VmRequestState.PROVISIONING)
    _arrived(made, node)


def _failure_text(made: VmRequest, code: str, message: str) -> str:
    why = {
        "RESOURCE_EXHAUSTED": "Google Cloud ran out of capacity or quota for it",
        "DEADLINE_EXCEEDED": "capacity did not come before the end of its window",
        "INVALID_ARGUMENT": "Google Cloud refused what it asks for",
        "PERMISSION_DENIED": "the portal's service account may not create TPU VMs in the "
        "lab's project (it needs roles/tpu.admin)",
    }.get(code, "Google Cloud failed it")
    return f"{made.name} was not made: {why}. {message}".strip()


def _arrived(made: VmRequest, node: NodeInfo) -> None:
    """A node is there: once READY, put it in the lab, connected, pinned, reconciled."""
    if node.state != NodeState.READY or not all(w.external_ip for w in node.workers):
        return
    if made.vm_id is not None:
        # The VM is made anew: its workers have new host keys, as a new VM does. That is
        # expected here, not an alarm: the pins are dropped and taken again from what
        # the new workers publish, before anyone has a shell on them. (A changed key on
        # a VM that was not made anew still stops provisioning and alerts the admins.)
        forget_host_keys(made.vm)
    vm = inventory.register_created(made.lab, node, requested_by=made.requested_by)
    with transaction.atomic():
        connect.wait_for_workers(vm, made.requested_by)
        if made.vm_id is not None:
            _run_again_what_it_lost(made)
        if made.vm_id is not None and vm.grants.exists():
            # Whole again once every worker has what the new machines need: jobs wait
            # for it and people are told then (``settle_grants``), so that the email's
            # "log in as before" is true when it arrives.
            TpuVm.objects.filter(pk=vm.pk).update(restore_version=F("desired_version"))
        VmRequest.objects.filter(pk=made.pk).update(
            state=VmRequestState.READY, vm=vm, ready_at=timezone.now(), changed_at=timezone.now()
        )
        audit.record(
            AuditAction.VM_CREATED,
            lab=made.lab,
            summary=f"{vm.name} ({vm.accelerator_type}, {vm.workers.count()} workers) is up",
            data={"request": made.pk, "vm": vm.pk},
        )


def forget_host_keys(vm: TpuVm) -> None:
    Worker.objects.filter(vm=vm).update(
        host_keys=[],
        host_keys_source=HostKeySource.NONE,
        host_keys_pinned_at=None,
        host_keys_pinned_by=None,
        host_key_mismatch_at=None,
        presented_host_key="",
        host_key_alarm_published=False,
        host_key_alerted_at=None,
        published_host_keys=[],
        published_keys_checked_at=None,
        published_keys_recheck=False,
    )


def _set(made: VmRequest, state: str, **fields) -> None:
    VmRequest.objects.filter(pk=made.pk).update(state=state, changed_at=timezone.now(), **fields)
    made.state = state


def _fail(made: VmRequest, code: str, text: str) -> None:
    with transaction.atomic():
        updated = VmRequest.objects.filter(pk=made.pk, state__in=OPEN_REQUEST_STATES).update(
            state=VmRequestState.FAILED, error_code=code, error=text, changed_at=timezone.now()
        )
        if updated:
            emails.send_vm_request_failed(made.pk)
            audit.record(
                AuditAction.VM_REQUEST_FAILED,
                lab=made.lab,
                summary=f"{made.name} in {made.zone}: {text[:300]}",
                data={"request": made.pk, "code": code},
            )
    made.state = VmRequestState.FAILED


# --- the end of the lab's grant -------------------------------------------------------


def warn_grant_ending(days: int = 7, today: dt.date | None = None) -> int:
    """Email a lab's admins once, a week before its TPU grant (and so its allowance)
    ends: what they hold, and that access ends and nothing can be made after it."""
    today = today or timezone.localdate()
    horizon = today + dt.timedelta(days=days)
    warned = 0
    for lab in Lab.objects.filter(grant_end_date__gte=today, grant_end_date__lte=horizon):
        try:
            with transaction.atomic():
                LabNotice.objects.create(
                    lab=lab, kind=LabNotice.Kind.GRANT_ENDING, about=lab.grant_end_date
                )
                emails.send_grant_ending(lab.pk, [u.__dict__ for u in allowance_use(lab)])
        except IntegrityError:  # told already
            continue
        warned += 1
    return warned

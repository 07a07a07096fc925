"""TPU VMs a lab admin asks the portal to make: checked before any call, made directly
(``CreateNode``) or queued until Google has capacity (a queued resource), followed until
the node is up, then registered in the lab already connected: the lab's key line is in
the node's ``ssh-keys`` metadata from its creation, its host keys are pinned from its
guest attributes, and the usual connection check confirms every worker takes the key.

A request is a ``VmRequest`` row. ``request_vm`` stores it and queues
``vm_request_work.send``, the work behind it: the call to Google, the looks at its
operation, and the follow-up (the ``follow-vm-requests`` pass every
``PORTAL_VM_REQUEST_POLL_SECONDS``) until it is up, failed or cancelled.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal import audit
from tpus import access, queue
from tpus.cloud import CloudError
from tpus.cloud.config import cloud_tpu
from tpus.cloud.operations import Started
from tpus.models import AuditAction, Lab, TpuVm
from tpus.models.inventory import validate_node_name
from tpus.models.provisioning import (
    OPEN_REQUEST_STATES,
    Provisioning,
    VmRequest,
    VmRequestState,
)
from tpus.services import allowances, vm_request_work

log = logging.getLogger(__name__)


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
            allowances.check_allowance(lab, spec.accelerator_type, spec.provisioning)
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
    spec = check_spec(lab, spec)  # the Cloud TPU API's answers, before any lock
    try:
        # Counted again with the lab locked: requests that passed the check above
        # together are stored one after the other, each seeing the ones before it.
        return store(lab, spec, requested_by=admin, request=request)
    except ValidationError as exc:
        raise ValidationError({"accelerator_type": exc.messages}) from None
    except IntegrityError:  # the same name asked for at the same moment
        raise ValidationError(
            {"name": [f"A request for {spec.name} in {spec.zone} is already under way."]}
        ) from None


def store(
    lab: Lab,
    spec: VmSpec,
    *,
    requested_by=None,
    elastic_pool=None,
    elastic_reason: str = "",
    request=None,
    standing: allowances.Standing | None = None,
) -> VmRequest:
    """Store a checked request and queue the call it stands for, in the transaction
    that claims its chips (``allowances.claim``, the lab's row locked): the one way a
    request is made, an admin's or the lab's elastic pool's (``elastic_pool``, with
    why it asked; ``standing``, what it counted with the lab's row locked already).
    Raises ValidationError (the allowance, the grant's end) or IntegrityError (the
    name asked for meanwhile) with nothing stored."""
    with transaction.atomic():
        allowances.claim(lab, spec.accelerator_type, spec.provisioning, standing=standing)
        made = VmRequest.objects.create(
            lab=lab,
            requested_by=requested_by,
            elastic_pool=elastic_pool,
            elastic_reason=elastic_reason[:300],
            **spec.__dict__,
        )
        summary = (
            f"{made.name} in {made.zone}: {made.accelerator_type} "
            f"{made.get_provisioning_display().lower()}"
            + (", queued" if made.queued else "")
            + (", kept alive" if made.keep_alive else "")
        )
        if elastic_pool is not None:
            summary += f", for the {elastic_pool.accelerator_type} elastic pool: {elastic_reason}"
        audit.record(
            AuditAction.ELASTIC_POOL_GREW if elastic_pool is not None else AuditAction.VM_REQUESTED,
            actor=requested_by,
            lab=lab,
            summary=summary[:500],
            data={"request": made.pk}
            | ({"elastic_pool": elastic_pool.pk} if elastic_pool is not None else {}),
            request=request,
        )
        queue.send_vm_request(made.pk)
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
    """Stop waiting for a VM: the queued resource's deletion is sent to Google (a node
    it made meanwhile goes with it) and the request is cancelled at once; the deletion
    is followed in the background (``vm_request_work.send``), and a failure of it is shown on the
    request. A request that is up or over is left as it is."""
    if not access.is_lab_admin(admin, made.lab):
        raise PermissionDenied("Only the lab's admins can cancel a TPU VM request.")
    made = VmRequest.objects.select_related("lab").get(pk=made.pk)
    if not made.is_open:
        return made
    started = Started()
    if made.cloud_id:
        try:
            started = cloud_tpu().begin_delete_queued_resource(
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
            if not started.done:
                vm_request_work.look_later(made, started.operation, vm_request_work.DELETE_REQUEST)
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

"""Writing to the audit log: one function, so every record has the same shape, and
the list of what can be recorded. Both apps write to it (accounts: keys, tokens,
usernames, admins' sign-ins; tpus: labs, VMs, grants), so it lives in neither.

The rows are ``tpus.models.AuditEvent`` (each may name a lab); this module finds the
model through Django's app registry rather than importing it, as a foreign key names
another app's model, so that writing to the log ties no app to another's code.
Reading a lab's log a page at a time is ``tpus.audit``.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.db import models

from portal.addresses import client_ip


class AuditAction(models.TextChoices):
    LAB_CREATED = "lab.created", "Lab created"
    LAB_UPDATED = "lab.updated", "Lab settings changed"
    MEMBERSHIP_REQUESTED = "membership.requested", "Asked to join"
    MEMBERSHIP_APPROVED = "membership.approved", "Membership approved"
    MEMBERSHIP_REJECTED = "membership.rejected", "Membership rejected"
    MEMBERSHIP_REMOVED = "membership.removed", "Member removed"
    ROLE_CHANGED = "membership.role_changed", "Role changed"
    SHARE_SET = "membership.share_set", "Share of the pool set"
    POLICY_ACCEPTED = "policy.accepted", "Policy accepted"
    INVITE_CREATED = "invite.created", "Invite created"
    INVITE_REVOKED = "invite.revoked", "Invite revoked"
    INVITE_ACCEPTED = "invite.accepted", "Invite accepted"
    ADMIN_LOGIN = "admin.login", "Admin signed in"
    TOKEN_CREATED = "token.created", "API token created"
    TOKEN_REVOKED = "token.revoked", "API token revoked"
    VM_IMPORTED = "vm.imported", "TPU VM imported"
    VM_REGISTERED = "vm.registered", "TPU VM registered by hand"
    VM_REQUESTED = "vm.requested", "TPU VM requested from Google Cloud"
    VM_REQUEST_CANCELLED = "vm.request_cancelled", "TPU VM request cancelled"
    VM_REQUEST_FAILED = "vm.request_failed", "TPU VM request failed"
    VM_KEPT_DOWN = "vm.kept_down", "Kept-alive TPU VM not asked for again (allowance or grant end)"
    VM_CREATED = "vm.created", "TPU VM created and added to the lab"
    ELASTIC_POOL_SET = "elastic_pool.set", "Elastic pool settings changed"
    ELASTIC_POOL_GREW = "elastic_pool.grew", "Elastic pool asked for a TPU VM"
    ELASTIC_POOL_SHRANK = "elastic_pool.shrank", "Elastic pool deleted an idle TPU VM"
    VM_STOP_REQUESTED = "vm.stop_requested", "TPU VM stop asked for"
    VM_START_REQUESTED = "vm.start_requested", "TPU VM start asked for"
    VM_DELETE_REQUESTED = "vm.delete_requested", "TPU VM deletion asked for"
    VM_DELETED = "vm.deleted", "TPU VM deleted"
    VM_CHANGE_FAILED = "vm.change_failed", "Stopping, starting or deleting a TPU VM failed"
    ALLOWANCE_SET = "lab.allowance_set", "Lab allowance set"
    VM_STATE_CHANGED = "vm.state_changed", "TPU VM state changed"
    VM_MISSING = "vm.missing", "TPU VM no longer listed"
    HOST_KEYS_PINNED = "vm.host_keys_pinned", "Host keys pinned"
    DISK_REGISTERED = "disk.registered", "Data disk registered"
    DISK_ATTACHED = "disk.attached", "Data disk attached"
    DISK_DETACHED = "disk.detached", "Data disk detached"
    DISK_OPERATION_FAILED = "disk.operation_failed", "Disk attach or detach failed"
    VM_CONNECT_REQUESTED = "vm.connect_requested", "Lab key added to the VM's metadata"
    VM_CONNECTED = "vm.connected", "Every worker accepts the lab key"
    VM_CONNECT_FAILED = "vm.connect_failed", "Connecting the VM failed"
    VM_DISCONNECTED = "vm.disconnected", "Lab key removed from the VM's metadata"
    GRANT_CREATED = "grant.created", "Access granted"
    GRANT_ACTIVE = "grant.active", "Access in force on every worker"
    GRANT_FAILED = "grant.failed", "Access failed"
    GRANT_REVOKED = "grant.revoked", "Access revoked"
    KIND_GRANT_CREATED = "kind_grant.created", "Access granted to every VM of a kind"
    KIND_GRANT_REVOKED = "kind_grant.revoked", "Access to every VM of a kind revoked"
    VM_RECONCILED = "vm.reconciled", "Workers reconciled"
    HOST_KEY_CHANGED = "vm.host_key_changed", "Host key changed"
    HOST_KEY_ALARM_CLEARED = "vm.host_key_alarm_cleared", "Host key matches the pin again"
    SYNC_FAILING = "lab.sync_failing", "Listing TPU VMs has been failing"
    SYNC_RECOVERED = "lab.sync_recovered", "Listing TPU VMs works again"
    DRIFT_FOUND = "vm.drift", "Unknown accounts found on a worker"
    IP_CHANGED = "vm.ip_changed", "External IP changed"
    WORKER_REBOOTED = "vm.worker_rebooted", "Worker rebooted"
    SSH_KEY_ADDED = "ssh_key.added", "SSH key added"
    SSH_KEY_DELETED = "ssh_key.deleted", "SSH key deleted"
    UNIX_USERNAME_CHOSEN = "unix_account.username_chosen", "Unix username chosen"
    JOB_SUBMITTED = "job.submitted", "Job submitted"
    JOB_STARTED = "job.started", "Job running on every worker"
    JOB_ENDED = "job.ended", "Job ended"
    IDLE_WARNED = "idle.warned", "Told of chips held idle"
    IDLE_ADMINS_TOLD = "idle.admins_told", "Admins told of chips held idle"
    IDLE_RELEASED = "idle.released", "Idle chips released by the lab's policy"
    IDLE_BUSY_AGAIN = "idle.busy_again", "Chips held idle are in use again"
    IDLE_EXEMPTIONS_SET = "idle.exemptions_set", "Exemptions from the idle-chips policy set"
    JOB_CANCEL_REQUESTED = "job.cancel_requested", "Job cancelled"
    JOB_MOVED = "job.moved", "Job moved to another VM of its kind"
    SNAPSHOT_REMOVED = "snapshot.removed", "Workdir snapshot removed"


def record(
    action: AuditAction,
    *,
    actor=None,
    lab=None,
    target_user=None,
    summary: str = "",
    data: dict[str, Any] | None = None,
    request=None,
):
    """Append one event (an ``AuditEvent``). ``actor`` None means the portal itself
    did it."""
    return apps.get_model("tpus", "AuditEvent").objects.create(
        action=action,
        actor=actor,
        lab=lab,
        target_user=target_user,
        summary=summary[:300],
        data=data or {},
        ip_address=client_ip(request),
    )

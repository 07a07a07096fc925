"""Celery tasks: thin wrappers that take ids, reload, check the row still calls for
the work, and call a service. They are queued only through ``tpus.queue``, by name:
each is ``tpus.tasks.<function>`` whichever module here holds it.

- ``periodic``: what beat runs (inventory sync, sweeps, expiry, the heartbeat);
- ``hosts``: work on a VM's workers (reconcile, connect, disk operations, scans);
- ``emails``: the messages, stored in the outbox by ``tpus.services.emails``;
- ``jobs``: moving jobs along, and looking at who holds a VM's chips;
- ``provisioning``: asking Google Cloud for the TPU VMs a lab requests, and following
  the requests until the VMs are up; the elastic pools' pass.
"""

from tpus.tasks.emails import (
    send_drift_alert,
    send_grant_email,
    send_host_key_alert,
    send_invite_email,
    send_ip_change_email,
    send_job_email,
    send_membership_email,
    send_sync_alert,
)
from tpus.tasks.hosts import (
    check_vm_connection,
    reconcile_vm,
    run_disk_operation,
    scan_worker_host_keys,
)
from tpus.tasks.jobs import (
    advance_jobs,
    check_tpu_usage,
    follow_idle_holders,
    look_at_idle_chips,
    poll_jobs,
)
from tpus.tasks.periodic import (
    expire_grants,
    expire_snapshots,
    reconcile_sweep,
    record_heartbeat,
    release_stalled_claims,
    sync_inventory,
    sync_lab_inventory,
)
from tpus.tasks.provisioning import (
    change_vm,
    check_elastic_pool,
    elastic_pools,
    follow_vm_change,
    follow_vm_requests,
    send_vm_request,
)

__all__ = [
    "advance_jobs",
    "change_vm",
    "check_elastic_pool",
    "check_tpu_usage",
    "check_vm_connection",
    "elastic_pools",
    "expire_grants",
    "expire_snapshots",
    "follow_vm_change",
    "follow_vm_requests",
    "follow_idle_holders",
    "look_at_idle_chips",
    "poll_jobs",
    "reconcile_sweep",
    "reconcile_vm",
    "record_heartbeat",
    "release_stalled_claims",
    "run_disk_operation",
    "scan_worker_host_keys",
    "send_drift_alert",
    "send_grant_email",
    "send_host_key_alert",
    "send_invite_email",
    "send_ip_change_email",
    "send_job_email",
    "send_membership_email",
    "send_sync_alert",
    "send_vm_request",
    "sync_inventory",
    "sync_lab_inventory",
]

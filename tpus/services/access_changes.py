"""The one place where a change to someone's access material reaches the TPU VMs.

Desired state lives in the database; hosts are made to match it by the reconciler of
each TPU VM. When something about a person changes that every VM they use must
reflect (a key added or deleted), the use case that made the change calls the
function here once, and it asks for a reconcile of each affected VM. Because
reconciling is idempotent, asking too often is harmless; forgetting to ask is not.
"""

from __future__ import annotations

from collections.abc import Sequence


def vms_with_access(user) -> Sequence:
    """Every TPU VM where ``user`` holds a grant that the hosts must reflect.

    The portal does not yet record TPU VMs or grants, so there are none. The
    provisioning code fills this in (a query over active and pending grants), and
    ``user_keys_changed`` then has work to do."""
    return ()


def request_reconcile(vm) -> None:
    """Ask for a reconcile of one TPU VM, after the current transaction commits.

    Nothing can be passed here until ``vms_with_access`` returns VMs; the provisioning
    code replaces this with the enqueue of its reconcile task."""
    raise NotImplementedError("Reconciling TPU VMs arrives with provisioning.")


def user_keys_changed(user) -> None:
    """``user``'s SSH keys changed: every TPU VM where they have access must rewrite
    their ``authorized_keys``. Called once per change, inside the change's transaction."""
    for vm in vms_with_access(user):
        request_reconcile(vm)

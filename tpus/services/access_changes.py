"""The one place where a change to someone's access material reaches the TPU VMs.

Desired state lives in the database; hosts are made to match it by the reconciler of
each TPU VM. When something about a person changes that every VM they use must
reflect (a key added or deleted), the use case that made the change calls the
function here once, and it asks for a reconcile of each affected VM. Because
reconciling is idempotent, asking too often is harmless; forgetting to ask is not.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpus.models import TpuVm
from tpus.models.grants import WANTED_STATES


def vms_with_access(user) -> Sequence[TpuVm]:
    """Every TPU VM where ``user`` holds a grant that the hosts must reflect."""
    return list(TpuVm.objects.filter(grants__user=user, grants__state__in=WANTED_STATES))


def request_reconcile(vm: TpuVm) -> None:
    """The VM's hosts must change: bump its desired version and reconcile after commit."""
    from tpus.services.grants import bump_version
    from tpus.services.grants import request_reconcile as enqueue

    bump_version(vm)
    enqueue(vm)


def user_keys_changed(user) -> None:
    """``user``'s SSH keys changed: every TPU VM where they have access must rewrite
    their ``authorized_keys``. Called once per change, inside the change's transaction."""
    for vm in vms_with_access(user):
        request_reconcile(vm)

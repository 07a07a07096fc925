"""The one place where a change to someone's access material reaches the TPU VMs.

Desired state lives in the database; hosts are made to match it by the reconciler of
each TPU VM. When something about a person changes that every VM they use must
reflect (a key added or deleted), the use case that made the change calls the
function here once, and it tells each affected VM's hosts they must change
(``tpus.services.hosts``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tpus.models import TpuVm
from tpus.models.grants import WANTED_STATES
from tpus.services.hosts import hosts_must_change


def vms_with_access(user) -> Sequence[TpuVm]:
    """Every TPU VM where ``user`` holds a grant that the hosts must reflect."""
    return list(TpuVm.objects.filter(grants__user=user, grants__state__in=WANTED_STATES))


def user_keys_changed(user) -> None:
    """``user``'s SSH keys changed: every TPU VM where they have access must rewrite
    their ``authorized_keys``. Called once per change, inside the change's transaction."""
    for vm in vms_with_access(user):
        hosts_must_change(vm, f"SSH keys of user {user.pk} changed")

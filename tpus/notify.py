"""Which emails go out when something happens in a lab. Each function enqueues a
task after the transaction commits, so no email describes a change that rolled back."""

from __future__ import annotations

from django.db import transaction


def _later(task, *args) -> None:
    transaction.on_commit(lambda: task.delay(*args))


def membership_requested(membership) -> None:
    from tpus.tasks import send_membership_email

    _later(send_membership_email, membership.pk, "requested")


def membership_decided(membership) -> None:
    from tpus.tasks import send_membership_email

    _later(send_membership_email, membership.pk, "decided")


def invite_created(invite, raw_token: str) -> None:
    from tpus.tasks import send_invite_email

    _later(send_invite_email, invite.pk, raw_token)


def access_active(grant) -> None:
    from tpus.tasks import send_grant_email

    _later(send_grant_email, grant.pk, "active")


def access_revoked(grant) -> None:
    from tpus.tasks import send_grant_email

    _later(send_grant_email, grant.pk, "revoked")


def grant_failed(grant) -> None:
    from tpus.tasks import send_grant_email

    _later(send_grant_email, grant.pk, "failed")


def expiry_warning(grant) -> None:
    from tpus.tasks import send_grant_email

    _later(send_grant_email, grant.pk, "expiring")


def host_key_changed(worker) -> None:
    from tpus.tasks import send_host_key_alert

    _later(send_host_key_alert, worker.pk)


def ip_changed(notice) -> None:
    from tpus.tasks import send_ip_change_email

    _later(send_ip_change_email, notice.pk)


def drift_found(worker, usernames: list[str]) -> None:
    from tpus.tasks import send_drift_alert

    _later(send_drift_alert, worker.pk, usernames)

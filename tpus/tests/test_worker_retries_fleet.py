"""A worker that failed for a reason the host can get over (the portal's account lost
sudo there) is tried again by itself, with the grants' back-off, so it heals within
about a minute of the fix with the portal's defaults, not at the next drift sweep."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from portal.settings import base
from tpus.models import WorkerSync
from tpus.services import maintenance
from tpus.services.grants import grant_access
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)

pytestmark = pytest.mark.fleet


def test_a_worker_whose_portal_account_lost_sudo_heals_soon_after_the_fix(
    pod,  # noqa: F811
    django_capture_on_commit_callbacks,
    settings,
):
    settings.PORTAL_GRANT_RETRY_SECONDS = base.PORTAL_GRANT_RETRY_SECONDS
    settings.PORTAL_GRANT_RETRY_MAX_SECONDS = base.PORTAL_GRANT_RETRY_MAX_SECONDS
    account = django_settings.PORTAL_LAB_SSH_USER
    host = pod.hosts[1]
    pod.fleet.exec(host.name, ["gpasswd", "-d", account, "google-sudoers"])

    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=False)
    grant.refresh_from_db()
    assert grant.state == "failed" and "tpu5-w1" in grant.error
    sync = WorkerSync.objects.get(worker__vm=pod.vm, worker__index=1)
    assert sync.retry_at is not None and not sync.last_error_retryable
    waits = (sync.retry_at - sync.last_attempt_at).total_seconds()
    assert base.PORTAL_GRANT_RETRY_SECONDS - 1 <= waits <= base.PORTAL_GRANT_RETRY_SECONDS + 1
    healthy = WorkerSync.objects.filter(worker__vm=pod.vm, retry_at__isnull=False)
    assert list(healthy.values_list("worker__index", flat=True)) == [1]

    # Not due yet: the frequent check leaves the hosts alone.
    with django_capture_on_commit_callbacks(execute=True):
        maintenance.rerun_stalled_claims()
    assert WorkerSync.objects.get(pk=sync.pk).failures == sync.failures

    # Still broken when it is due: tried, and the next try is further away.
    WorkerSync.objects.filter(pk=sync.pk).update(retry_at=timezone.now() - dt.timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        maintenance.rerun_stalled_claims()
    again = WorkerSync.objects.get(pk=sync.pk)
    assert again.failures == sync.failures + 1
    assert (again.retry_at - again.last_attempt_at).total_seconds() > waits

    # The admin gives the account its sudo back; at the next due try it heals.
    pod.fleet.exec(host.name, ["usermod", "-aG", "google-sudoers", account])
    WorkerSync.objects.filter(pk=sync.pk).update(retry_at=timezone.now() - dt.timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        maintenance.rerun_stalled_claims()
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    healed = WorkerSync.objects.get(pk=sync.pk)
    assert healed.retry_at is None and healed.last_error == ""
    assert pod.ssh("tpu5-w1", "id -un").returncode == 0

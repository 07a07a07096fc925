"""Two runs for one VM that meet on a worker: the worker keeps the highest version of
the VM's desired state it has applied and refuses an older one, whatever order the
two runs' scripts get the host's lock in. Real sshd hosts of the test fleet."""

from __future__ import annotations

import dataclasses

import pytest

from tpus.remote.desired import DesiredState, encode
from tpus.tests.test_provisioning import pod  # noqa: F401 (the fixture)
from tpus.tests.test_reconcile_script import _uids, new_name, state, target, user  # noqa: F401

pytestmark = pytest.mark.fleet


def versioned(desired: DesiredState, series: str, version: int) -> DesiredState:
    return dataclasses.replace(desired, series=series, version=version)


def test_an_older_state_reaching_a_worker_after_a_revoke_changes_nothing(target):  # noqa: F811
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("milo")
    series = f"vm1-{uid}"
    target.reconcile(versioned(state(user(name, uid, public)), series, 4))
    revoked = target.reconcile(versioned(state(user(name, uid, public, active=False)), series, 5))
    assert revoked.values["revoked"] == "1"
    before = target.snapshot()

    # The run that read the state before the revoke gets the host's lock last.
    late = target.reconcile(versioned(state(user(name, uid, public)), series, 4))

    assert late.values["stale"] == "5"
    assert late.values["noop"] == "1" and late.values["changed"] == "0"
    assert late.values["boot_id"] == target.host.boot_id
    assert target.snapshot() == before
    assert target.ssh(name, key).returncode == 255
    # Its own, the version private; the folder only passed through (job logs are in it).
    assert target.sh("stat -c '%a %U' /var/lib/tpu-portal /var/lib/tpu-portal/version") == (
        "711 root\n600 root\n"
    )


def test_the_same_version_again_is_applied_and_a_new_series_starts_afresh(target):  # noqa: F811
    name, uid = new_name(), next(_uids)
    key, public = target.new_key("ana")
    desired = state(user(name, uid, public))
    target.reconcile(versioned(desired, f"vm2-{uid}", 9))
    again = target.reconcile(versioned(desired, f"vm2-{uid}", 9))
    assert "stale" not in again.values and again.values["noop"] == "1"
    # The VM registered again (or the host given to another VM): its own series.
    fresh = target.reconcile(versioned(state(user(name, uid, public, active=False)), "vm3-1", 1))
    assert "stale" not in fresh.values and fresh.values["revoked"] == "1"
    assert target.ssh(name, key).returncode == 255


def test_a_state_without_a_version_is_never_refused(target):  # noqa: F811
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("sam")
    target.reconcile(versioned(state(user(name, uid, public)), f"vm4-{uid}", 50))
    plain = target.reconcile(state(user(name, uid, public, active=False)))
    assert "stale" not in plain.values and plain.values["revoked"] == "1"


@pytest.mark.parametrize(
    "line",
    [
        "version vm1 -1",
        "version vm1 01",
        "version -vm1 1",
        "version VM1 1",
        "version vm1 1 2",
        "version vm1 1234567890123456789",
    ],
)
def test_a_bad_version_line_is_refused_and_nothing_changes(target, line):  # noqa: F811
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("bad")
    text = encode(state(user(name, uid, public))).decode().split("\n")
    text.insert(2, line)
    target.reconcile(state())  # the first run through sudo leaves its own marks
    before = target.snapshot()
    with pytest.raises(Exception, match="reconcile: "):
        target.reconcile("\n".join(text).encode())
    assert target.snapshot() == before


def test_the_version_line_must_be_the_third(target):  # noqa: F811
    name, uid = new_name(), next(_uids)
    _, public = target.new_key("late")
    text = encode(state(user(name, uid, public))).decode().split("\n")
    text.insert(3, "version vm1 1")
    with pytest.raises(Exception, match="line 3"):
        target.reconcile("\n".join(text).encode())


@pytest.mark.parametrize(
    "series, version",
    [("", 1), ("-a", 1), ("A", 1), ("a" * 65, 1), ("vm1", -1), ("vm1", True), ("vm1", 10**18)],
)
def test_the_encoder_refuses_a_bad_series_or_version(series, version):
    desired = versioned(state(), series, version)
    if not series:
        assert b"version" not in encode(desired)  # no ordering asked for
        return
    with pytest.raises(ValueError):
        encode(desired)


def test_the_encoder_puts_the_version_on_the_third_line():
    text = encode(versioned(state(), "vm7-123", 42)).decode()
    assert text.split("\n")[:3] == [
        "tpu-portal-desired 1",
        "range 30000 59999",
        "version vm7-123 42",
    ]


def test_a_version_planted_on_a_worker_by_root_there_fails_the_revoke_instead_of_skipping_it(
    pod,  # noqa: F811
    django_capture_on_commit_callbacks,
):
    from tpus.models import Grant, Worker
    from tpus.services.grants import grant_access, revoke_access
    from tpus.services.reconcile import series

    with django_capture_on_commit_callbacks(execute=True):
        [grant] = grant_access(pod.admin, pod.lab, pod.milo, [pod.vm], sudo=True)
    assert Grant.objects.get(pk=grant.pk).state == "active"
    # A sudoer on worker 1 plants a version far ahead, hoping to skip their revoke.
    planted = f"{series(pod.vm)} 999999\n"
    pod.fleet.exec(pod.hosts[1].name, ["sh", "-c", "cat > /var/lib/tpu-portal/version"],
                   input=planted.encode())  # fmt: skip

    with django_capture_on_commit_callbacks(execute=True):
        revoke_access(pod.admin, Grant.objects.get(pk=grant.pk))

    grant.refresh_from_db()
    assert grant.state == "revoking"  # never counted as done
    sync = Worker.objects.get(vm=pod.vm, index=1).sync
    assert "never sent" in sync.last_error and not sync.last_error_retryable
    name = pod.fresh(pod.milo).unix_account.username

    def password_field(host) -> str:
        out = pod.fleet.exec(host.name, ["getent", "shadow", name]).stdout.decode()
        return out.split(":")[1]

    assert password_field(pod.hosts[0]) == "!*"  # locked where the version was honest
    assert password_field(pod.hosts[1]) == "*"  # skipped there, and the portal says so

"""The lab's policy on idle chips on a real sshd host of the test fleet. A job at 0 %
duty cycle is cancelled as a cancel does, and the next job in line starts. A notebook-like
process the portal did not start holds a chip, the stand-in of libtpu's metrics server
reports 0 % duty cycle, the holder look records it and its samples, and the pass (with
the lab's minutes set short) warns its person, tells the admins and releases it with
holder-stop.sh through the remote door: TERM, which it ignores, then KILL. The script
itself never signals a pid that is another process now, or one that let the chips go."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import pytest
from django.urls import reverse
from django.utils import timezone

from portal.models import OutboxMessage
from testfleet import runtime_metrics
from tests.requirements import need
from tpus.models import ChipSample, IdleHolding, Job, TpuVm
from tpus.services import idle_holders, job_engine
from tpus.services.jobs import cancel_job
from tpus.tests.test_jobs_pages_fleet import milo_granted_on_tpu5

pytestmark = pytest.mark.fleet

GIB = 1024**3
JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
IDLE = [{"chip": c, "hbm_used": 5 * GIB, "hbm_total": 32 * GIB, "duty": 0.0} for c in range(4)]
# Holds chip 1 (its sleeps do not), ignores TERM, idles.
NOTEBOOK = "trap '' TERM; exec 3</dev/accel1; while :; do sleep 1 3<&-; done"


@pytest.fixture
def tpu5(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    fleet_settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 1
    fleet_settings.PORTAL_IDLE_RELEASE_GRACE_SECONDS = 1
    [host] = fleet_hosts(1)
    lab, admin, vm, milo, key = milo_granted_on_tpu5(
        tpu_emulator, fleet, host, fleet_username, tmp_path,
        make_lab, make_user, add_member, django_capture_on_commit_callbacks,
    )  # fmt: skip
    lab.idle_policy_enabled = True
    lab.idle_warn_minutes = lab.idle_admins_minutes = 1
    lab.idle_release = True
    lab.save()
    milo = type(milo).objects.select_related("unix_account").get(pk=milo.pk)
    return vm, milo, admin, host


def start_notebook(fleet, host, user: str, group: str | None = None) -> int:
    out = fleet.exec(
        host.name,
        ["sh", "-c", f"setpriv --reuid={user} --regid={group or user} --init-groups -- sh -c "
                     f"\"{NOTEBOOK}\" >/dev/null 2>&1 </dev/null & echo $!"],
    ).stdout  # fmt: skip
    pid = int(out.strip())
    assert running(fleet, host, pid), f"the notebook of {user} did not start"
    return pid


def running(fleet, host, pid: int) -> bool:
    state = fleet.exec(host.name, ["sh", "-c", f"cat /proc/{pid}/stat 2>/dev/null || true"])
    text = state.stdout.decode() if isinstance(state.stdout, bytes) else state.stdout
    return bool(text) and text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_an_idle_notebook_outside_the_portal_is_warned_then_released_by_the_lab_policy(
    tpu5, fleet, tmp_path, django_capture_on_commit_callbacks
):
    vm, milo, admin, host = tpu5
    values = tmp_path / "chips.json"
    runtime_metrics.write_values(values, IDLE)
    pid = start_notebook(fleet, host, milo.unix_account.username)
    try:
        with runtime_metrics.serve(fleet, host.name, values):
            job_engine.check_usage(vm.pk)  # the holder look, with its chip samples
            vm = TpuVm.objects.get(pk=vm.pk)
            [held] = vm.outside_holders
            assert held["pid"] == str(pid) and held["device"] == "/dev/accel1"
            assert held["start"].isdigit()
            assert ChipSample.objects.filter(vm=vm, duty=0.0).count() == 4
            looked = timezone.now()

            with django_capture_on_commit_callbacks(execute=True):
                report = idle_holders.run_pass(now=looked + dt.timedelta(seconds=61))
            [row] = IdleHolding.objects.all()
            assert report.warned == [row.pk] and row.person == milo
            assert OutboxMessage.objects.filter(kind="idle_warned", to=milo.email).exists()
            assert running(fleet, host, pid)

            job_engine.check_usage(vm.pk)  # still idle at the next look
            with django_capture_on_commit_callbacks(execute=True):
                report = idle_holders.run_pass(now=looked + dt.timedelta(seconds=122))
        assert report.admins_told == [row.pk] and report.released == [row.pk]
        row.refresh_from_db()
        assert row.outcome == "ended with KILL after the grace period", row.outcome
        assert not running(fleet, host, pid)
        assert OutboxMessage.objects.filter(kind="idle_admins", to=admin.email).exists()
        assert OutboxMessage.objects.filter(kind="idle_released", to=milo.email).exists()
        # Free for the queue: the VM lists no holder, and the next look agrees.
        assert TpuVm.objects.get(pk=vm.pk).outside_holders == []
        assert job_engine.check_usage(vm.pk) == []
    finally:
        fleet.exec(host.name, ["sh", "-c", f"kill -KILL {pid} 2>/dev/null || true"])


def _poll(vm, capture) -> None:
    with capture(execute=True):
        job_engine.advance(vm.pk)


def test_an_idle_job_is_cancelled_by_the_lab_policy_and_the_next_job_in_line_starts(
    client, tpu5, fleet, tmp_path, django_capture_on_commit_callbacks
):
    vm, milo, admin, host = tpu5
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{milo.unix_account.username}/venv"])
    capture = django_capture_on_commit_callbacks
    values = tmp_path / "chips.json"
    runtime_metrics.write_values(values, IDLE)
    with runtime_metrics.serve(fleet, host.name, values):
        idle = _running_job(client, vm, milo, capture)
        client.force_login(milo)
        with capture(execute=True):
            client.post(
                reverse("job_submit", args=["vision", vm.pk]),
                {"command": 'python -c "import time; time.sleep(300)"', "python": "~/venv"},
            )
        waiting = Job.objects.exclude(pk=idle.pk).get()
        try:
            _poll(vm, capture)  # the poll reads the chips at 0 %
            assert ChipSample.objects.filter(vm=vm, duty=0.0).exists()
            polled = timezone.now()
            with capture(execute=True):
                idle_holders.run_pass(now=polled + dt.timedelta(seconds=61))
            _poll(vm, capture)
            with capture(execute=True):
                report = idle_holders.run_pass(now=polled + dt.timedelta(seconds=122))
            [row] = IdleHolding.objects.all()
            assert row.job == idle and report.released == [row.pk]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _poll(vm, capture)
                waiting.refresh_from_db()
                if waiting.state == "running" or waiting.has_ended:
                    break
                time.sleep(0.3)
            idle.refresh_from_db()
            assert idle.state == "cancelled" and "policy on idle chips" in idle.reason
            assert waiting.state == "running", (waiting.state, waiting.reason)
            page = client.get(reverse("vm_jobs", args=["vision", vm.pk])).content.decode()
            assert "by the lab&#x27;s policy" in page or "by the lab's policy" in page
        finally:
            for job in (idle, waiting):
                with capture(execute=True):
                    cancel_job(job, milo)
            _poll(vm, capture)


def _running_job(client, vm, milo, capture) -> Job:
    """milo's job (it sleeps) queued with the form and started by the VM's pass."""
    client.force_login(milo)
    with capture(execute=True):
        response = client.post(
            reverse("job_submit", args=["vision", vm.pk]),
            {"command": 'python -c "import time; time.sleep(300)"', "python": "~/venv"},
        )
    assert response.status_code == 302, response.content.decode()[-2000:]
    job = Job.objects.get()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _poll(vm, capture)
        job.refresh_from_db()
        if job.state == "running" or job.has_ended:
            break
        time.sleep(0.3)
    assert job.state == "running", (job.state, job.reason, job.preflight)
    return job


# --- the script on a host, through the remote door ---------------------------------


@pytest.fixture
def worker(fleet, fleet_settings, fleet_host):
    from tpus.remote import HostKeyPins, Worker, site_login

    pins = HostKeyPins.parse(fleet.host_keys(fleet_host.name))
    return Worker(fleet_host.ip, pins, name=fleet_host.name, login=site_login())


def stop(worker, pid: int, start: int, grace: int = 1):
    from tpus.remote import run_script
    from tpus.remote.jobs import encode_holder_stop, parse_holder_stop

    data = encode_holder_stop(pid, start, "/dev/accel*", grace)
    return parse_holder_stop(run_script(worker, "holder-stop.sh", data).values)


def start_time(fleet, host, pid: int) -> int:
    stat = fleet.exec(host.name, ["cat", f"/proc/{pid}/stat"]).stdout
    stat = stat.decode() if isinstance(stat, bytes) else stat
    return int(stat.rsplit(")", 1)[1].split()[19])


def test_holder_stop_signals_nothing_when_the_pid_is_another_process_or_holds_no_chip(
    worker, fleet, fleet_host
):
    holder = start_notebook(fleet, fleet_host, "nobody", "nogroup")
    idle = int(
        fleet.exec(
            fleet_host.name, ["sh", "-c", "sleep 300 >/dev/null 2>&1 </dev/null & echo $!"]
        ).stdout.strip()
    )
    try:
        assert stop(worker, holder, start_time(fleet, fleet_host, holder) + 1) == ("other", False)
        assert running(fleet, fleet_host, holder)
        assert stop(worker, idle, start_time(fleet, fleet_host, idle)) == ("released", True)
        assert running(fleet, fleet_host, idle)
        assert stop(worker, holder, start_time(fleet, fleet_host, holder)) == ("kill", False)
        assert not running(fleet, fleet_host, holder)
        assert stop(worker, holder, 1) == ("gone", False)
    finally:
        for pid in (holder, idle):
            fleet.exec(fleet_host.name, ["sh", "-c", f"kill -KILL {pid} 2>/dev/null || true"])


@pytest.mark.parametrize(
    "line",
    [b"pid 0", b"pid 12;id", b"start -1", b"chips /etc/passwd", b"chips /dev/../etc",
     b"grace 601", b"pid 1\npid 2"],
)  # fmt: skip
def test_holder_stop_refuses_malformed_input_whole(worker, line):
    from tpus.remote import RemoteError, run_script

    good = {b"pid": b"pid 999999", b"start": b"start 1", b"chips": b"chips /dev/accel*",
            b"grace": b"grace 1"}  # fmt: skip
    key = line.split(b" ", 1)[0]
    lines = [line if k == key else v for k, v in good.items()]
    data = b"tpu-portal-holder-stop 1\n" + b"\n".join(lines) + b"\nend\n"
    with pytest.raises(RemoteError) as refused:
        run_script(worker, "holder-stop.sh", data)
    assert refused.value.kind == RemoteError.SCRIPT

"""Chip metrics on a real sshd host of the test fleet: a stand-in of libtpu's metrics
server (the same gRPC service, real grpcio) answers with numbers the test sets; the
job poll reads them in its one status exec per worker and they reach the VM's model,
its page and the API. A worker where nothing serves metrics says so, and the poll is
otherwise what it was."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.db.models import Max, Sum
from django.urls import reverse

from accounts.services import create_token
from testfleet import runtime_metrics
from tests.requirements import need
from tpus.models import ChipSample, Job, TpuVm, VmDutyDay
from tpus.services import job_engine
from tpus.services.jobs import cancel_job
from tpus.tests.test_jobs_pages_fleet import milo_granted_on_tpu5

pytestmark = pytest.mark.fleet

JAX_ENV = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
GIB = 1024**3
CHIPS = [
    {"chip": 0, "hbm_used": 12 * GIB, "hbm_total": 32 * GIB, "duty": 85.0},
    {"chip": 1, "hbm_used": 3 * GIB, "hbm_total": 32 * GIB, "duty": 40.5},
]


@pytest.fixture
def tpu5(
    tpu_emulator, fleet, fleet_hosts, fleet_settings, fleet_username, fleet_uids, tmp_path,
    make_lab, make_user, add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    # Every poll reads the metrics (by default at most one in two does).
    fleet_settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 1
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    [host] = fleet_hosts(1)
    lab, admin, vm, milo, key = milo_granted_on_tpu5(
        tpu_emulator, fleet, host, fleet_username, tmp_path,
        make_lab, make_user, add_member, django_capture_on_commit_callbacks,
    )  # fmt: skip
    fleet.exec(host.name, ["ln", "-sfn", JAX_ENV, f"/home/{fleet_username}/venv"])
    milo.refresh_from_db()
    return vm, milo, admin, host


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
        with capture(execute=True):
            job_engine.advance(vm.pk)
        job.refresh_from_db()
        if job.state == "running" or job.has_ended:
            break
        time.sleep(0.3)
    assert job.state == "running", (job.state, job.reason, job.preflight)
    return job


def _stop(job, milo, capture) -> None:
    with capture(execute=True):
        cancel_job(job, milo)
        job_engine.advance(job.vm_id)


def test_numbers_a_metrics_server_on_the_worker_serves_reach_the_model_the_page_and_the_api(
    client, tpu5, fleet, tmp_path, django_capture_on_commit_callbacks
):
    vm, milo, admin, host = tpu5
    values = tmp_path / "chips.json"
    runtime_metrics.write_values(values, CHIPS)
    capture = django_capture_on_commit_callbacks
    with runtime_metrics.serve(fleet, host.name, values):
        job = _running_job(client, vm, milo, capture)
        try:
            # The job's processes were given the ports libtpu serves its metrics on.
            pid = job.parts.get().pid
            environ = fleet.exec(host.name, ["cat", f"/proc/{pid}/environ"]).stdout
            assert b"TPU_RUNTIME_METRICS_PORTS=8431,8432,8433,8434" in environ.split(b"\0")

            with capture(execute=True):
                job_engine.advance(vm.pk)
            vm = TpuVm.objects.get(pk=vm.pk)
            assert vm.chip_metrics == [
                {
                    "worker": 0,
                    "none": "",
                    "chips": [
                        {"chip": 0, "used": 12 * GIB, "total": 32 * GIB, "duty": 85.0},
                        {"chip": 1, "used": 3 * GIB, "total": 32 * GIB, "duty": 40.5},
                    ],
                }
            ]
            assert set(ChipSample.objects.values_list("chip", "hbm_used")) == {
                (0, 12 * GIB),
                (1, 3 * GIB),
            }

            # New numbers: the next poll shows them.
            runtime_metrics.write_values(values, [{**CHIPS[0], "hbm_used": 30 * GIB}])
            with capture(execute=True):
                job_engine.advance(vm.pk)
            vm.refresh_from_db()
            assert [c["used"] for c in vm.chip_metrics[0]["chips"]] == [30 * GIB]
            # Each reading after the first added its interval to the VM's day row, at
            # the chips' mean duty cycle then: 62.75 % for both, 85 % for the one.
            days = VmDutyDay.objects.filter(vm=vm).aggregate(
                observed=Sum("observed"), duty=Sum("duty"), peak=Max("hbm_peak")
            )
            assert days["observed"] > 0
            assert 0.6275 - 1e-9 <= days["duty"] / days["observed"] <= 0.85 + 1e-9
            assert days["peak"] == pytest.approx(30 / 32)

            client.force_login(milo)
            page = client.get(reverse("vm_jobs", args=["vision", vm.pk])).content.decode()
            assert 'id="chip-metrics"' in page
            assert "30.0 of 32.0 GiB" in page and "85%" in page
            assert f"job {job.pk} of {milo.unix_account.username}" in page

            token = create_token(milo, "t")[1]
            now = client.get(
                "/api/v1/labs/vision/usage/now", HTTP_AUTHORIZATION=f"Bearer {token}"
            ).json()
            [row] = now["items"]
            chip = row["chips"]["workers"][0]["chips"][0]
            assert chip["hbm_used_bytes"] == 30 * GIB and chip["duty_cycle_percent"] == 85.0
            admin_token = create_token(admin, "t")[1]
            detail = client.get(
                f"/api/v1/labs/vision/vms/{vm.pk}", HTTP_AUTHORIZATION=f"Bearer {admin_token}"
            ).json()
            assert detail["chips"]["summary"]["hbm_used_bytes"] == 30 * GIB
        finally:
            _stop(job, milo, capture)


def test_a_worker_without_a_metrics_server_reports_no_metrics_and_the_poll_goes_on(
    client, tpu5, django_capture_on_commit_callbacks
):
    vm, milo, _, _ = tpu5
    capture = django_capture_on_commit_callbacks
    job = _running_job(client, vm, milo, capture)
    try:
        with capture(execute=True):
            job_engine.advance(vm.pk)
        vm = TpuVm.objects.get(pk=vm.pk)
        [worker] = vm.chip_metrics
        assert worker["chips"] == []
        assert worker["none"] == "nothing listens on port(s) 8431,8432,8433,8434"
        assert not ChipSample.objects.exists()
        job.refresh_from_db()
        part = job.parts.get()
        assert job.state == "running" and part.state == "running" and part.error == ""
        client.force_login(milo)
        page = client.get(reverse("vm_jobs", args=["vision", vm.pk])).content.decode()
        assert "No metrics" in page
    finally:
        _stop(job, milo, capture)


# --- the scripts on a host, through the remote door ---------------------------------


@pytest.fixture
def worker(fleet, fleet_settings, fleet_host):
    from tpus.remote import HostKeyPins, Worker, site_login

    pins = HostKeyPins.parse(fleet.host_keys(fleet_host.name))
    return Worker(fleet_host.ip, pins, name=fleet_host.name, login=site_login())


def _status(worker, ports=(8431,)):
    from tpus.remote import run_script
    from tpus.remote.jobs import encode_status, parse_status

    data = encode_status({}, max_bytes=0, device_glob="/dev/accel*", metrics_ports=ports)
    return parse_status(run_script(worker, "job-status.sh", data).pairs)


@pytest.mark.parametrize(
    "line",
    [b"metrics 80", b"metrics 8431,", b"metrics 8431 8432", b"metrics 8431;id",
     b"metrics " + b",".join(b"%d" % p for p in range(9000, 9009))],
)  # fmt: skip
def test_job_status_refuses_a_malformed_metrics_line_whole(worker, line):
    from tpus.remote import RemoteError, run_script

    data = b"tpu-portal-job-status 1\nmax_bytes 0\n" + line + b"\nend\n"
    with pytest.raises(RemoteError) as refused:
        run_script(worker, "job-status.sh", data)
    assert refused.value.kind == RemoteError.SCRIPT


def test_job_start_refuses_the_metrics_ports_as_a_jobs_own_variable(worker, fleet_username):
    from tpus.remote import RemoteError, run_script
    from tpus.remote.jobs import StartJob, encode_start

    good = encode_start(StartJob(job_id="m1", user=fleet_username, argv=("true",)))
    for bad in (b"env TPU_RUNTIME_METRICS_PORTS ODQzMQ==\nend\n", b"metrics_ports 84\nend\n"):
        with pytest.raises(RemoteError) as refused:
            run_script(worker, "job-start.sh", good.replace(b"end\n", bad))
        assert refused.value.kind == RemoteError.SCRIPT


def test_a_server_that_answers_no_metrics_or_impossible_ones_gives_none(
    worker, fleet, fleet_host, tmp_path
):
    values = tmp_path / "chips.json"  # not written yet: the server answers UNAVAILABLE
    with runtime_metrics.serve(fleet, fleet_host.name, values, port=8432):
        report = _status(worker, ports=(8431, 8432))
        assert report.metrics.none == "no answer from libtpu" and report.lock_holder is None
        runtime_metrics.write_values(values, [{**CHIPS[0], "hbm_used": 64 * GIB}])
        assert _status(worker, ports=(8432,)).metrics.none == "no answer from libtpu"
        runtime_metrics.write_values(values, CHIPS)
        assert [c.chip for c in _status(worker, ports=(8432,)).metrics.chips] == [0, 1]

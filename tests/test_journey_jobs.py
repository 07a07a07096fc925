"""Journey 5 in a real browser, on the sshd fleet: milo, with access to tpu5 (a 4-worker
pod), queues a JAX job from the VM's page; a second job waits behind it; the page
follows the states and the live log of every worker without a reload; milo cancels the
first, the second runs and succeeds, he runs it again, and the lab's usage page counts
it.

The production way: the live server takes the form, a real Celery worker runs the
VM's passes through the broker, Celery beat polls the jobs, and the workers run real
JAX (the CPU build) across the pod with jax.distributed."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.requirements import need
from tests.test_journey_access import sign_in, worker_env  # noqa: F401 (fixtures)
from tpus.models import Job
from tpus.services import inventory
from tpus.services.grants import grant_access
from tpus.tests.test_jobs_host import JAX_ENV, POD_PY

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.fleet]

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)


@pytest.fixture
def beat(celery_beat):
    """Celery beat beside the worker, polling jobs every second (the other periodic
    work far apart, so it stays out of the way)."""
    return celery_beat(PORTAL_JOB_POLL_SECONDS="1", PORTAL_SYNC_SECONDS="3600")


@pytest.fixture
def pod(
    worker_env, beat, tpu_emulator, fleet, fleet_hosts, fleet_username, make_lab, make_user,  # noqa: F811
    add_member, django_capture_on_commit_callbacks,
):  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    hosts = fleet_hosts(4)
    lab = make_lab("Vision Lab", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example", password=PASSWORD)
    add_member(lab, milo)
    from accounts.unix import choose_username

    choose_username(milo, fleet_username)
    # The access itself is journey 2's; here it is in force before milo opens the page.
    from portal.celery import app

    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        with django_capture_on_commit_callbacks(execute=True):
            [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    finally:
        app.conf.task_always_eager = eager
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    home = f"/home/{fleet_username}"
    for host in hosts:
        fleet.exec(host.name, ["sh", "-c", f"ln -sfn {JAX_ENV} {home}/jax && "
                               f"chown -h {fleet_username}: {home}/jax"])  # fmt: skip
        fleet.exec(host.name, ["sh", "-c", f"cat > {home}/pod.py && chown {fleet_username}: "
                               f"{home}/pod.py"], input=POD_PY.encode())  # fmt: skip
    return vm


def _story(job: Job, fleet) -> str:
    """What the portal and the hosts know of ``job``: for a failure's message."""
    job.refresh_from_db()
    lines = [f"job {job.pk} {job.state}: {job.reason}"]
    for part in job.parts.order_by("index"):
        lines.append(f"  worker {part.index}: {part.state} exit={part.exit_status} "
                     f"signal={part.signal} error={part.error}")  # fmt: skip
    folder = f"/var/lib/tpu-portal/jobs/{job.host_id}"
    for host in fleet.hosts.values():
        if not host.running:
            continue
        found = fleet.exec(host.name, ["sh", "-c", f"ls {folder} && cat {folder}/supervisor.log"
                                       f" {folder}/exit 2>&1"], check=False)  # fmt: skip
        if found.returncode == 0:
            lines.append(f"  {host.name}: {found.stdout.decode(errors='replace').strip()}")
    return "\n".join(lines)


def _expect_state(page, job: Job, fleet, text: str, timeout: int) -> None:
    try:
        expect(page.locator("#job-state .badge")).to_have_text(text, timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_story(job, fleet)}") from None


def test_milo_queues_follows_cancels_and_reruns_a_pod_job(pod, sign_in, tmp_path, fleet):  # noqa: F811
    vm = pod
    milo = sign_in("milo@uni.example")
    milo.set_viewport_size({"width": 1280, "height": 900})
    milo.goto(f"/labs/vision/vms/{vm.pk}/#jobs")
    expect(milo.locator("#tpu-now")).to_contain_text("Free")

    def queue(script_args: str) -> None:
        form = milo.locator("#job-run form")
        form.get_by_label("or a script in your home").fill("pod.py")
        form.get_by_label("Its arguments").fill(script_args)
        form.get_by_label("Python environment").fill("~/jax")
        form.get_by_label("Environment variables").fill(
            "XLA_FLAGS=--xla_force_host_platform_device_count=4"
        )
        form.get_by_role("button", name=f"Queue on {vm.name}").click()

    # The first job stays after its collective; the second is queued behind it.
    queue("stay")
    milo.wait_for_url("**/jobs/*/")
    first = Job.objects.order_by("pk").last()
    milo.evaluate("window.notReloaded = true")
    for index in range(4):
        expect(milo.locator(f"#job-log-{index}")).to_contain_text(
            f"process {index} devices 16 sum 120.0", timeout=90_000
        )
        expect(milo.locator(f"#job-log-{index}")).to_contain_text("staying")
    expect(milo.locator("#job-state .badge")).to_have_text("Running")
    assert milo.evaluate("window.notReloaded") is True  # followed live, no reload
    milo.screenshot(path=str(tmp_path / "1-running.png"), full_page=True)

    milo.goto(f"/labs/vision/vms/{vm.pk}/#jobs")
    expect(milo.locator("#tpu-now")).to_contain_text("Running")
    queue("")
    milo.wait_for_url("**/jobs/*/")
    second = Job.objects.order_by("pk").last()
    assert second.pk != first.pk
    expect(milo.locator("#job-state .badge")).to_have_text("Queued")
    milo.goto(f"/labs/vision/vms/{vm.pk}/#jobs")
    expect(milo.locator(f"#queued-job-{second.pk}")).to_be_visible()

    # Cancel the first from its page: TERM, grace, KILL on every worker; the second
    # starts in the same pass and succeeds on all four.
    milo.goto(f"/labs/vision/vms/{vm.pk}/jobs/{first.pk}/")
    milo.once("dialog", lambda dialog: dialog.accept())
    milo.get_by_role("button", name="Cancel").click()
    expect(milo.locator("#job-state .badge")).to_have_text("Cancelled", timeout=60_000)
    milo.goto(f"/labs/vision/vms/{vm.pk}/jobs/{second.pk}/")
    _expect_state(milo, second, fleet, "Succeeded", 120_000)
    for index in range(4):
        expect(milo.locator(f"#job-log-{index}")).to_contain_text(
            f"process {index} devices 16 sum 120.0"
        )
    milo.screenshot(path=str(tmp_path / "2-succeeded.png"), full_page=True)

    # Run it again: the same settings, a new job that succeeds too.
    milo.get_by_role("button", name="Run again").click()
    milo.wait_for_url(lambda url: f"/jobs/{second.pk}/" not in url and "/jobs/" in url)
    third = Job.objects.order_by("pk").last()
    assert (third.rerun_of_id, third.script, third.args) == (second.pk, second.script, [])
    _expect_state(milo, third, fleet, "Succeeded", 120_000)

    # The lab's usage page counts milo's worker-hours, and the TPU is free again.
    milo.goto("/labs/vision/usage/")
    expect(milo.locator("#usage-period")).to_contain_text("milo")
    expect(milo.locator(f"#now-{vm.pk}")).to_contain_text("Free")
    milo.screenshot(path=str(tmp_path / "3-usage.png"), full_page=True)
    states = dict(Job.objects.filter(vm=vm).values_list("pk", "state"))
    assert states == {first.pk: "cancelled", second.pk: "succeeded", third.pk: "succeeded"}

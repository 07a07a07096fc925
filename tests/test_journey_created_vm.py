"""A TPU VM the portal makes and keeps, in a real browser, on the sshd fleet: the lab
admin asks for a spot v4-32 as a queued request in a zone that has no capacity; it
waits, visibly, until capacity is released; it comes up connected (the lab's key is in
its metadata from the start) with its hosts' keys pinned, and the admin gives milo
access. Milo fetches his ssh config through his refresh URL, logs in on every worker
and starts a job he marks "run it again after a preemption". Google preempts the VM:
milo's job is lost and he is told once; the portal asks for the VM again, it comes
back on machines made new, everything is restored, milo is told once that it is back,
the config he already had (refreshed as cron would) logs him in again, and his job
runs again by itself.

The production way: the browser talks to the live server, a real Celery worker takes
every request, sync, reconcile and job pass from the broker, Celery beat drives the
periodic passes, the guest agent on the fleet applies the nodes' metadata, and mail
goes through a real SMTP server."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect

from testfleet.guestagent import offer_hosts
from tests.requirements import need
from tests.test_journey_access import sign_in, worker_env  # noqa: F401 (fixtures)
from tpus.models import Grant, Job, LabAllowance, TpuVm, VmConnection, VmRequest
from tpus.services.grants import grant_access
from tpus.tests.test_jobs_host import JAX_ENV

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.fleet]

PROJECT, ZONE = "vision-lab-1", "us-central2-b"
PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)


@pytest.fixture
def beat(celery_beat):
    """Celery beat beside the worker: requests followed every 2 s, the inventory
    synced every 5 s (how a preemption is noticed), jobs polled every second."""
    return celery_beat(
        PORTAL_VM_REQUEST_POLL_SECONDS="2", PORTAL_SYNC_SECONDS="5", PORTAL_JOB_POLL_SECONDS="1"
    )


@pytest.fixture
def scene(
    worker_env, monkeypatch, beat, guest_agent, tpu_emulator, fleet, fleet_hosts,  # noqa: F811
    fleet_username, tmp_path, make_lab, make_user, add_member,
):  # fmt: skip
    monkeypatch.setenv("PORTAL_CONNECT_POLL_SECONDS", "1")
    hosts = fleet_hosts(4)
    lab = make_lab("Vision Lab", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, admin, role="admin")
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=16)
    milo = make_user("milo@uni.example", password=PASSWORD)
    add_member(lab, milo)
    from accounts.unix import choose_username

    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    choose_username(milo, fleet_username)
    key = tmp_path / "id_milo"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "milo@laptop", "-f", str(key)],
        check=True,
    )
    from accounts.keys import add_key

    add_key(milo, key.with_suffix(".pub").read_text().strip(), label="laptop")
    # The zone has no v4-32 to give; the fleet's hosts are what Google makes VMs of.
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    offer_hosts(fleet, tpu_emulator.controls.store, [h.name for h in hosts])
    return lab, admin, milo, key, fleet_username


def _ssh(config: Path, known: Path, key: Path, host: str, command: str = "id -un"):
    return subprocess.run(
        ["ssh", "-F", str(config), "-o", f"UserKnownHostsFile={known}", "-i", str(key),
         "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
         host, command],
        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _fetch(urls: list[str], config: Path, known: Path) -> None:
    """What milo's cron line does: both files again from his refresh URL."""
    for url, path in zip(urls, (config, known), strict=True):
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (live server)
            path.write_bytes(response.read())


def _without_date(config: Path) -> str:
    return re.sub(r", generated [^.]*UTC\.", "", config.read_text())


def _expect_state(page, job: Job, text: str, timeout: int) -> None:
    try:
        expect(page.locator("#job-state .badge")).to_have_text(text, timeout=timeout)
    except AssertionError as exc:
        job.refresh_from_db()
        checks = job.preflight
        raise AssertionError(f"{exc}\njob {job.pk} {job.state}: {job.reason}\n{checks}") from None


def _wait(what: str, ready, timeout: float = 90.0, story=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        found = ready()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s: {what}\n{story()}")
        time.sleep(0.3)


def _vm_story(vm: TpuVm) -> str:
    """What the portal knows of the VM, its requests and its jobs: for a failure."""
    vm.refresh_from_db()
    lines = [f"{vm.name}: {vm.state} restore_version={vm.restore_version} "
             f"restored_at={vm.restored_at} node_created_at={vm.node_created_at}"]  # fmt: skip
    for r in VmRequest.objects.filter(lab=vm.lab).order_by("pk"):
        lines.append(f"  request {r.pk}: {r.state} ready_at={r.ready_at} {r.error}")
    for j in Job.objects.filter(vm=vm).order_by("pk"):
        lines.append(f"  job {j.pk}: {j.state} began={j.begun_at} ended={j.ended_at} "
                     f"rerun_of={j.rerun_of_id} {j.reason}")  # fmt: skip
    return "\n".join(lines)


def test_a_created_spot_pod_waits_comes_up_is_preempted_and_comes_back_with_everything(
    scene,
    sign_in,  # noqa: F811
    smtp_sink,
    fleet,
    tpu_emulator,
    tmp_path,
):
    lab, _, milo_user, key, username = scene
    vm_name, workers = "tpu5", ("tpu5", "tpu5-w1", "tpu5-w2", "tpu5-w3")

    # The admin asks for a spot v4-32 that waits for capacity and is kept alive.
    admin = sign_in("boss@vision.example")
    admin.goto(f"/labs/{lab.slug}/vms/new/")
    expect(admin.locator("#allowance-heading")).to_be_visible()
    admin.get_by_label("Name").fill(vm_name)
    admin.get_by_label("Zone").select_option(ZONE)
    admin.get_by_label("Accelerator type").fill("v4-32")
    admin.get_by_label("Runtime version").fill("tpu-ubuntu2204-base")
    admin.get_by_label("Spot").check()
    admin.get_by_label("Wait for capacity (a queued request)").check()
    admin.get_by_label("Keep it alive").check()
    admin.get_by_role("button", name="Create").click()
    expect(admin.locator(".messages")).to_contain_text("tpu5 is asked for: it waits for capacity")
    made = VmRequest.objects.get(lab=lab, name=vm_name)
    _wait("the request waits for capacity",
          lambda: VmRequest.objects.get(pk=made.pk).state == "waiting")  # fmt: skip
    admin.reload()
    row = admin.locator("#requests-heading + table tbody tr").first
    expect(row).to_contain_text("Waiting for resources")
    expect(row).to_contain_text("Spot, queued, kept alive")
    admin.screenshot(path=tmp_path / "1-waiting.png", full_page=True)

    # Capacity comes: the VM is made of the fleet's hosts, connected and pinned.
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    _wait("the request is done", lambda: VmRequest.objects.get(pk=made.pk).state == "ready")
    vm = TpuVm.objects.get(lab=lab, name=vm_name)
    _wait("tpu5 is connected",
          lambda: VmConnection.objects.filter(vm=vm, state="connected").exists(), 60)  # fmt: skip
    assert all(w.is_pinned for w in vm.workers.all())
    admin.reload()
    expect(row).to_contain_text("Up")
    admin.goto(f"/labs/{lab.slug}/vms/{vm.pk}/")
    expect(admin.locator("body")).to_contain_text("v4-32")

    # The admin gives milo access; his account is made on every worker.
    [grant] = grant_access(scene[1], lab, milo_user, [vm], sudo=False)
    _wait("milo's grant is active",
          lambda: Grant.objects.get(pk=grant.pk).state == "active", timeout=60)  # fmt: skip
    smtp_sink.wait_for("milo@uni.example", f"You can now use {vm_name}", timeout=30)

    # Milo makes a refresh URL and fetches his files as his cron line does.
    milo = sign_in("milo@uni.example")
    milo.goto("/ssh/")
    milo.click("text=Make a refresh URL")
    urls = re.findall(r"curl -fsS (\S+) -o", milo.locator("#refresh-command").inner_text())
    config, known = tmp_path / "config", tmp_path / "known_hosts"
    _fetch(urls, config, known)
    before = _without_date(config)
    for host in workers:
        result = _ssh(config, known, key, host)
        assert result.returncode == 0, (host, result.stderr)
        assert result.stdout.strip() == username
    # His Python environment, in his home on every worker (a link to the JAX build).
    for host in workers:
        assert _ssh(config, known, key, host, f"ln -sfn {JAX_ENV} ~/jax").returncode == 0

    # He starts a long job and asks for it to run again after a preemption.
    milo.goto(f"/labs/{lab.slug}/vms/{vm.pk}/#jobs")
    form = milo.locator("#job-run form")
    form.get_by_label("Command", exact=True).fill(
        "python3 -c \"import time; print('training', flush=True); time.sleep(600)\""
    )
    form.get_by_label("Python environment").fill("~/jax")
    form.get_by_label("Run it again after a preemption").check()
    form.get_by_role("button", name=f"Queue on {vm_name}").click()
    milo.wait_for_url("**/jobs/*/")
    first = Job.objects.get(vm=vm)
    _expect_state(milo, first, "Running", 60_000)

    # Google takes the VM back. The sync notices; the job is lost, and milo is told.
    tpu_emulator.controls.preempt(vm_name)
    expect(milo.locator("#job-state .badge")).to_have_text("Lost", timeout=60_000)
    smtp_sink.wait_for("milo@uni.example", f"Job {first.pk} on {vm_name}: lost", timeout=30)

    # Kept alive, it is asked for again and comes back on machines made new; the
    # guest agent renews the released hosts and the emulator makes the node of them.
    again = _wait("tpu5 is asked for again",
                  lambda: VmRequest.objects.exclude(pk=made.pk).first())  # fmt: skip
    assert (again.name, again.queued, again.keep_alive) == (vm_name, True, True)
    _wait("tpu5 is back", lambda: VmRequest.objects.get(pk=again.pk).state == "ready", 120)
    back = smtp_sink.wait_for("milo@uni.example", f"{vm_name} is back", timeout=60)
    assert f"ssh {vm_name}" in smtp_sink.body(back)

    # The config he already had logs him in again, on every worker, once his cron line
    # has fetched the new host keys: the same names, no prompt, no alarm.
    _fetch(urls, config, known)
    assert _without_date(config) == before
    for host in workers:
        result = _ssh(config, known, key, host)
        assert result.returncode == 0, (host, result.stderr)
        assert result.stdout.strip() == username
    assert not vm.workers.filter(host_key_mismatch_at__isnull=False).exists()

    # His job is queued again by itself; on the new machines his home is new, so it
    # waits, saying for what, until he puts his environment back.
    rerun = _wait(
        "the job is queued again",
        lambda: Job.objects.filter(rerun_of=first).first(),
        story=lambda: _vm_story(vm),
    )
    _wait(
        "the job waits for milo's environment",
        lambda: Job.objects.get(pk=rerun.pk).reason.startswith("Waiting for what it needs"),
        story=lambda: _vm_story(vm),
    )
    # Each pass checks again (the page says "Validating" meanwhile): reload until the
    # page shows it waiting, as milo would.
    page_url = f"/labs/{lab.slug}/vms/{vm.pk}/jobs/{rerun.pk}/"
    _wait(
        "the job's page says what it waits for",
        lambda: (
            milo.goto(page_url)
            and "Waiting for what it needs in your home" in milo.locator("body").inner_text()
        ),
        timeout=30,
    )
    for host in workers:
        assert _ssh(config, known, key, host, f"ln -sfn {JAX_ENV} ~/jax").returncode == 0
    _expect_state(milo, rerun, "Running", 90_000)
    expect(milo.locator("#job-log-3")).to_contain_text("training", timeout=30_000)
    milo.screenshot(path=tmp_path / "2-running-again.png", full_page=True)

    # One email of each kind: the lost job, the VM back.
    time.sleep(2)
    subjects = [m["Subject"] for m in smtp_sink.messages if "milo@uni.example" in m["To"]]
    assert sum(f"{vm_name} is back" in s for s in subjects) == 1, subjects
    assert sum(f"Job {first.pk} on {vm_name}: lost" in s for s in subjects) == 1, subjects
    milo.once("dialog", lambda dialog: dialog.accept())
    milo.get_by_role("button", name="Cancel").click()
    expect(milo.locator("#job-state .badge")).to_have_text("Cancelled", timeout=60_000)

"""``bin/demo`` followed to the letter in a real browser: its setup (the site admin,
then ``demo_lab`` on the sshd fleet and the emulator) prints two logins and four
steps; the site admin does step 1 and milo steps 2 to 4, doing only what the output
and the pages say, until ``ssh tpu5`` answers from worker 0 and the pasted JAX job has
summed one number from every worker of the pod on each of them; then the VM's page
says who uses the TPU and the lab's usage page counts the job. A step that needs
knowledge from anywhere else fails here.

As in the demo, the browser talks to a web server, the grant is a task a real Celery
worker takes from the broker, Celery beat polls the job, the worker reaches the fleet
over SSH with the lab's own key, the person's ssh client finds its files where the
page put them, and the job is real JAX (the CPU build) across the four hosts with
jax.distributed. Every step is saved at a phone's width and a desktop's under
``test-artifacts/demo/`` for a person to look at."""

from __future__ import annotations

import io
import os
import re
import shlex
from pathlib import Path

import pytest
from django.core.management import call_command
from playwright.sync_api import expect

from tests.e2e import ARTIFACTS, ROOT, expect_every_worker_up_to_date, screenshots
from tests.laptop import Laptop, new_key
from tests.requirements import need
from tests.test_journey_jobs import beat  # noqa: F401 (a fixture)
from tpus.management.commands.demo_lab import set_up_demo
from tpus.models import Job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.quickstart,
    pytest.mark.demo,
    pytest.mark.browser,
    pytest.mark.fleet,
]


@pytest.fixture
def worker_env(monkeypatch, settings, live_server, tpu_emulator, fleet_settings, fleet_uids):
    """The demo's settings, as this process and the Celery worker process see them:
    links to the live server, the test's emulator and UIDs, and no admin MFA (the demo
    runs on ``portal.settings.local``, where it is off unless asked for)."""
    settings.SITE_URL = live_server.url
    settings.PORTAL_REQUIRE_ADMIN_MFA = False
    # What bin/demo sets for its fake chips, read from the script itself.
    script = (ROOT / "bin" / "demo").read_text()
    assert re.search(r"^export .*\bPORTAL_JOB_REQUIRE_LIBTPU=false\b", script, re.M), script
    settings.PORTAL_JOB_REQUIRE_LIBTPU = False
    monkeypatch.setenv("PORTAL_JOB_REQUIRE_LIBTPU", "false")
    jax_env = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
    need(Path(jax_env, "bin", "python").exists(), f"no JAX in {jax_env} (bin/setup test)")
    monkeypatch.setenv("SITE_URL", live_server.url)
    monkeypatch.setenv("PORTAL_REQUIRE_ADMIN_MFA", "false")
    monkeypatch.setenv("PORTAL_UID_MIN", str(settings.PORTAL_UID_MIN))
    monkeypatch.setenv("PORTAL_UID_MAX", str(settings.PORTAL_UID_MAX))
    monkeypatch.setenv("PORTAL_TEST_TPU_API_ENDPOINT", settings.TPU_API_ENDPOINT)
    monkeypatch.setenv("PORTAL_REMOTE_CONNECT_TIMEOUT", "5")
    monkeypatch.setenv("PORTAL_REMOTE_AUTH_TIMEOUT", "10")
    monkeypatch.setenv("PORTAL_REMOTE_SCRIPT_TIMEOUT", "60")
    # A shell that never set the site admin's login: the demo makes one up.
    for name in ("PORTAL_ADMIN_EMAIL", "PORTAL_ADMIN_PASSWORD", "PORTAL_ADMIN_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def printed(worker_env, celery_worker_process, fleet, tpu_emulator) -> str:
    """What ``bin/demo`` prints before the portal starts: ``ensure_site_admin``, then
    ``demo_lab`` (whose command runs ``set_up_demo`` on the fleet's slot; the test
    session holds this fleet's slot, so the function gets the fleet itself). bin/demo
    runs these two, in this order, after ``migrate``, and lets both print."""
    script = (ROOT / "bin" / "demo").read_text()
    commands = re.findall(r"^(?:\w+=\$\()?python manage\.py ([^\s)]+)([^)\n]*)\)?$", script, re.M)
    assert commands[1:] == [
        ("ensure_site_admin", ""),
        ("demo_lab", ' --state "$state" --slot "$slot"'),
    ]
    # Both kept, and printed once, together, only once the portal answers HTTP (its
    # own start prints no login: PORTAL_PREPARED).
    assert re.search(
        r"^PORTAL_PREPARED=1 bin/portal &\n(?:.*\n)*?"
        r"^if python -m portal\.wait_for_web http://127\.0\.0\.1:8000/healthz [^\n]*; then\n"
        r"  printf '[^']*' \"\$admin_login\" \"\$steps\"\n",
        script,
        re.M,
    ), script
    assert script.count("$admin_login") == 1 and script.count("$steps") == 1
    for host in sorted(fleet.hosts.values(), key=lambda h: h.index)[:4]:
        fleet.heal(host.name)
    out = io.StringIO()
    call_command("ensure_site_admin", stdout=out)
    out.write(set_up_demo(fleet, tpu_emulator.controls) + "\n")
    return out.getvalue()


def _one(pattern: str, text: str) -> tuple[str, ...]:
    found = re.search(pattern, text, re.M)
    assert found, f"the demo's output does not match {pattern!r}:\n{text}"
    return found.groups()


def _sign_in(page, email: str, password: str) -> None:
    """The sign-in form the portal shows to someone who is not signed in."""
    assert "/accounts/login/" in page.url, page.url
    page.fill("input[name=login]", email)
    page.fill("input[name=password]", password)
    page.click("form button[type=submit]")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)
    # No step the output does not name, such as setting up two-factor first.
    assert "/mfa/" not in page.url, page.url


def _download(page, link_text: str, downloads: Path) -> Path:
    """Click the page's link and save the file as a browser does, in ~/Downloads
    under the name the portal gives it."""
    with page.expect_download() as download:
        page.get_by_role("link", name=link_text, exact=True).click()
    saved = downloads / download.value.suggested_filename
    download.value.save_as(saved)
    return saved


def test_the_demo_output_and_the_pages_take_milo_from_bin_demo_to_a_jax_job_on_tpu5(
    printed,
    beat,  # noqa: F811 (the fixture imported above)
    browser,
    live_server,
    fleet,
    tmp_path,
):
    shots = ARTIFACTS / "demo"
    shots.mkdir(parents=True, exist_ok=True)
    (shots / "demo-output.txt").write_text(printed)
    admin_email, admin_password = _one(r"^Site admin login: (\S+) / (\S+)$", printed)
    milo_email, milo_password, milo_key = _one(
        r"^Collaborator login: (\S+) / (\S+) \(his SSH key: (\S+)\)$", printed
    )
    steps = re.findall(r"^(\d)\. (.+)$", printed, re.M)
    assert [n for n, _ in steps] == ["1", "2", "3", "4"], printed
    step1, step2, step3, step4 = (text for _, text in steps)
    # Step 4's command is the line right under it, whole, to paste.
    lines = printed.splitlines()
    job_command = lines[lines.index(f"4. {step4}") + 1]
    workers = sorted(fleet.hosts.values(), key=lambda h: h.index)[:4]

    context = browser.new_context(base_url=live_server.url, accept_downloads=True)
    context.set_default_timeout(15_000)
    page = context.new_page()

    # 1. The site admin opens tpu5's page, signs in, and adds milo.
    url, heading, who, field, button, done = _one(
        r"^Open (\S+) and sign in as the site admin \(the login above\); "
        r'under "([^"]+)", type (\S+) in "([^"]+)" and click "([^"]+)": '
        r'each worker\'s progress shows live until "([^"]+)"$',
        step1,
    )
    page.goto(url)
    _sign_in(page, admin_email, admin_password)
    assert page.url == url
    page.wait_for_load_state("load")  # htmx has wired the page up
    expect(page.get_by_role("heading", name=heading, exact=True)).to_be_visible()
    screenshots(page, shots, "1-vm-access-page")
    page.get_by_role("combobox", name=field, exact=True).fill(who)
    page.get_by_role("button", name=button, exact=True).click()
    page.wait_for_url(url)
    expect(page.get_by_text(done, exact=True)).to_be_visible(timeout=90_000)
    # Access is in place on every worker of the pod.
    progress = page.locator("#vm-progress")
    expect_every_worker_up_to_date(progress, len(workers))
    expect(progress.locator("tr", has_text=milo_email).locator(".badge")).to_have_text("Active")
    screenshots(page, shots, "2-milo-added")

    # 2. Milo, in the same browser, signs in and installs his ssh config and host keys.
    sign_out, url, config_link, known_link = _one(
        r'^Click "([^"]+)", open (\S+) and sign in as milo \(the collaborator login above\); '
        r'click "([^"]+)" and "([^"]+)", then paste the commands under them into a '
        r"terminal: they put both files in ~/\.ssh\.$",
        step2,
    )
    page.get_by_role("button", name=sign_out, exact=True).click()
    page.wait_for_load_state("load")
    page.goto(url)
    _sign_in(page, milo_email, milo_password)
    assert page.url == url
    laptop = Laptop(tmp_path / "home")
    config = _download(page, config_link, laptop.path("~/Downloads"))
    known = _download(page, known_link, laptop.path("~/Downloads"))
    # The commands right under the links, as the page shows them.
    card = page.locator("section", has=page.get_by_role("link", name=config_link, exact=True))
    commands = card.locator("pre").first.inner_text()
    assert config.name in commands and known.name in commands, commands
    screenshots(page, shots, "3-ssh-page")
    installed = laptop.shell(commands)
    assert installed.returncode == 0, (commands, installed.stderr)
    # Where the page says each download goes, under ~/.ssh.
    for link in (config_link, known_link):
        target = card.get_by_role("link", name=link, exact=True).locator("xpath=following::code[1]")
        where = target.inner_text()
        assert where.startswith("~/.ssh/") and laptop.path(where).is_file(), where
    assert not config.exists() and not known.exists()

    # 3. Then the printed ssh command, with a command for the VM to run.
    [command] = _one(r"^Then: (ssh .+)$", step3)
    argv = shlex.split(command)
    assert milo_key in argv, command
    result = laptop.run(
        ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *argv[1:], "hostname"]
    )
    assert result.returncode == 0, (command, result.stderr)
    names = [fleet.exec(h.name, ["hostname"]).stdout.decode().strip() for h in workers]
    assert len(set(names)) == len(names), names
    assert result.stdout.strip() == names[0]
    (shots / "4-ssh-tpu5-hostname.txt").write_text(f"$ {command} hostname\n{result.stdout}")

    # 4. Milo runs the printed job on the pod from the VM's page.
    who, url, command_field, python_env, python_field, queue, ending = _one(
        r"^Run a job: as (\S+), open (\S+), paste the line below into \"([^\"]+)\", "
        r'type (\S+) in "([^"]+)" and click "([^"]+)": the job\'s page shows every '
        r'worker\'s log, each ending with "([^"]+)"\.$',
        step4,
    )
    assert who == "milo"
    page.goto(url)
    form = page.locator("#job-run")
    # The page says why no TPU runtime is asked for here.
    expect(form.locator("#job-libtpu-note")).to_contain_text("chips are fake")
    form.get_by_label(command_field, exact=True).fill(job_command)
    form.get_by_label(python_field, exact=True).fill(python_env)
    screenshots(page, shots, "5-job-form")
    form.get_by_role("button", name=queue, exact=True).click()
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job = Job.objects.get(pk=int(page.url.rstrip("/").rsplit("/", 1)[1]))
    expect(page.locator("#job-command")).to_be_visible()
    # Meanwhile, in another tab, tpu5's page says who is using it: milo's job, on the
    # TPU or first in line (it takes seconds to start JAX on four workers).
    other = context.new_page()
    other.goto(url)
    now = other.locator("#vm-jobs-now")
    expect(now).to_contain_text("milo")
    expect(now.locator(f"a[href$='/jobs/{job.pk}/']").first).to_be_visible()
    screenshots(other, shots, "6-who-uses-tpu5-while-the-job-runs")
    other.close()
    # Every worker's own log shows its line of the one psum over the whole pod.
    for index in range(len(workers)):
        log = page.locator(f"#job-log-{index}")
        expect(log).to_contain_text(f"worker {index} of {len(workers)}", timeout=120_000)
        expect(log).to_contain_text(ending)
    expect(page.locator("#job-state .badge")).to_have_text("Succeeded", timeout=60_000)
    screenshots(page, shots, "7-job-page")
    job.refresh_from_db()
    assert job.state == "succeeded" and job.worker_count == len(workers), job.reason

    # Who is using this TPU: the VM's page, now that the job is done, and its jobs.
    page.goto(url)
    expect(page.locator("#tpu-now")).to_contain_text("Free")
    expect(page.locator(f"#recent-job-{job.pk}")).to_contain_text("Succeeded")
    screenshots(page, shots, "8-who-uses-tpu5-after")

    # The lab's usage page counts the job's worker-hours for milo on tpu5.
    page.goto(url.split("/vms/")[0] + "/")
    page.get_by_role("link", name="TPU usage", exact=True).click()
    page.wait_for_load_state("load")
    expect(page.locator("#usage-people tbody tr").first).to_contain_text("milo")
    expect(page.locator("#usage-vms tbody tr").first).to_contain_text("tpu5")
    expect(page.locator("#usage-total")).not_to_have_text("0")
    screenshots(page, shots, "9-usage")
    context.close()


def test_a_newcomer_on_the_demo_signs_up_joins_is_added_to_tpu5_and_runs_the_job(
    printed,
    beat,  # noqa: F811 (the fixture imported above)
    browser,
    live_server,
    fleet,
    smtp_sink,
    tmp_path,
):
    """The demo's lab with someone who was not made for it: sign up, verify, add a key,
    ask to join; the site admin approves (on a phone) and adds them to tpu5 as step 1
    says for milo; then the ssh config, plain ``ssh tpu5`` and step 4's job."""
    shots = ARTIFACTS / "demo" / "newcomer"
    admin_email, admin_password = _one(r"^Site admin login: (\S+) / (\S+)$", printed)
    steps = dict(re.findall(r"^(\d)\. (.+)$", printed, re.M))
    lines = printed.splitlines()
    job_command = lines[lines.index(f"4. {steps['4']}") + 1]
    access_url = _one(r"^Open (\S+) and sign in as the site admin", steps["1"])[0]
    vm_url = _one(r"open (\S+), paste the line below", steps["4"])[0]
    workers = sorted(fleet.hosts.values(), key=lambda h: h.index)[:4]
    email, password = "nina@uni.example", "a long passphrase 42"

    def new_page():
        context = browser.new_context(base_url=live_server.url, accept_downloads=True)
        context.set_default_timeout(15_000)
        return context, context.new_page()

    nina_context, nina = new_page()
    # Sign up and verify the emailed link.
    nina.goto("/accounts/signup/")
    nina.fill("input[name=email]", email)
    nina.fill("input[name=password1]", password)
    nina.fill("input[name=password2]", password)
    nina.click("form button[type=submit]")
    expect(nina.get_by_role("heading", name="Verify Your Email Address")).to_be_visible()
    screenshots(nina, shots, "1-verify-your-email")
    message = smtp_sink.wait_for(email, "Confirm")
    nina.goto(smtp_sink.link(message, r"http://[^\s]+/accounts/confirm-email/\S+"))
    nina.click("form button[type=submit]")
    expect(nina.get_by_role("heading", name="Hello, nina")).to_be_visible()
    screenshots(nina, shots, "2-signed-in")

    # A key of her laptop's, and her unix username.
    laptop = Laptop(tmp_path / "nina")
    public_key = new_key(laptop)
    nina.goto("/account/keys/")
    nina.fill("textarea[name=key_text]", public_key)
    nina.get_by_role("button", name="Add key").click()
    expect(nina.locator("body")).to_contain_text("Key added")
    nina.fill("input[name=username]", "nina")
    nina.click("form[action='/account/keys/username/'] button")
    expect(nina.locator("body")).to_contain_text("Your unix username is nina")
    screenshots(nina, shots, "3-key-and-username")

    # She asks to join the Demo Lab and accepts its policy.
    nina.get_by_role("link", name="Labs", exact=True).click()
    nina.get_by_role("link", name="Ask to join").click()
    nina.fill("textarea[name=purpose]", "Trying JAX on a pod.")
    nina.check("input[name=accept_policy]")
    screenshots(nina, shots, "4-ask-to-join")
    nina.get_by_role("button", name="Send request").click()
    expect(nina.get_by_text("Request pending").first).to_be_visible()

    # The site admin approves her on a phone: the buttons are on screen.
    admin_context, admin = new_page()
    admin.goto(access_url.split("/vms/")[0] + "/admin/")
    _sign_in(admin, admin_email, admin_password)
    admin.set_viewport_size({"width": 375, "height": 900})
    row = admin.locator("#request-list tr", has_text=email)
    approve = row.get_by_role("button", name="Approve")
    reject = row.get_by_role("button", name="Reject")
    for button in (approve, reject):
        box = button.bounding_box()
        assert box and 0 <= box["x"] and box["x"] + box["width"] <= 375, box
    screenshots(admin, shots, "5-requests-to-join")
    admin.set_viewport_size({"width": 375, "height": 900})
    approve.click()
    expect(row.locator(".badge")).to_have_text("Approved")

    # … and adds her to tpu5, as step 1 says for milo.
    admin.set_viewport_size({"width": 1280, "height": 900})
    admin.goto(access_url)
    admin.wait_for_load_state("load")
    admin.get_by_role("combobox", name="Member", exact=True).fill("nina")
    admin.get_by_role("button", name="Add to tpu5", exact=True).click()
    admin.wait_for_url(access_url)
    expect(admin.get_by_text("nina can now use tpu5.", exact=True)).to_be_visible(timeout=90_000)
    expect_every_worker_up_to_date(admin.locator("#vm-progress"), len(workers))
    # One state for her grant, live, everywhere on the page.
    expect(admin.locator("#vm-access tr", has_text=email).locator(".badge")).to_have_text("Active")
    screenshots(admin, shots, "6-nina-added")
    admin_context.close()

    # Her ssh config and host keys, then plain `ssh tpu5` with her default key.
    nina.goto("/ssh/")
    config = _download(nina, "Download config", laptop.path("~/Downloads"))
    known = _download(nina, "Download known_hosts", laptop.path("~/Downloads"))
    card = nina.locator("section", has=nina.get_by_role("link", name="Download config"))
    commands = card.locator("pre").first.inner_text()
    assert config.name in commands and known.name in commands
    installed = laptop.shell(commands)
    assert installed.returncode == 0, (commands, installed.stderr)
    result = laptop.ssh("tpu5", "id -un; hostname")
    assert result.returncode == 0, result.stderr
    first = fleet.exec(workers[0].name, ["hostname"]).stdout.decode().strip()
    assert result.stdout.split() == ["nina", first]

    # Step 4's job, from tpu5's page; every worker's log has its part of the psum.
    nina.goto(vm_url)
    form = nina.locator("#job-run")
    form.get_by_label("Command", exact=True).fill(job_command)
    form.get_by_label("Python environment", exact=True).fill("~/venv")
    form.get_by_role("button", name="Queue on tpu5", exact=True).click()
    nina.wait_for_url(re.compile(r"/jobs/\d+/$"))
    for index in range(len(workers)):
        expect(nina.locator(f"#job-log-{index}")).to_contain_text(
            f"worker {index} of {len(workers)} psum over {len(workers)} devices = "
            f"{float(len(workers))}",
            timeout=120_000,
        )
    expect(nina.locator("#job-state .badge")).to_have_text("Succeeded", timeout=60_000)
    screenshots(nina, shots, "7-job")
    nina_context.close()


def test_a_restarted_demo_does_not_ask_again_to_add_milo_who_has_access(
    worker_env, fleet, tpu_emulator
):
    """``set_up_demo`` run again (bin/demo restarted) once milo has access to tpu5:
    step 1 says so instead of asking to add him. (No Celery worker here: what the set
    up queues runs in this process, so nothing of it outlives the test.)"""
    from tpus.models import Grant, TpuVm

    workers = sorted(fleet.hosts.values(), key=lambda h: h.index)[:4]
    for host in workers:
        fleet.heal(host.name)
    call_command("ensure_site_admin", stdout=io.StringIO())
    try:
        first = set_up_demo(fleet, tpu_emulator.controls)
        assert 'type milo in "Member" and click "Add to tpu5"' in first
        vm = TpuVm.objects.get(name="tpu5", lab__slug="demo")
        milo = Grant._meta.get_field("user").related_model.objects.get(email="milo@demo.example")
        grant = Grant.objects.create(user=milo, vm=vm, state="active")

        again = set_up_demo(fleet, tpu_emulator.controls)

        [step1] = re.findall(r"^1\. (.+)$", again, re.M)
        assert step1.startswith(
            "milo has had access to tpu5 since an earlier run of the demo: open "
        ), step1
        assert 'to try "Add to tpu5" again, click "Revoke" there first' in step1
        assert 'type milo in "Member"' not in again
        Grant.objects.filter(pk=grant.pk).update(state="revoked")
        assert 'type milo in "Member" and click "Add to tpu5"' in set_up_demo(
            fleet, tpu_emulator.controls
        )
    finally:
        # The other journeys give milo a UID of their own: leave no account of his.
        for host in workers:
            fleet.exec(host.name, ["sh", "-c", "userdel -r milo 2>/dev/null; true"], check=False)

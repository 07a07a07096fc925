"""Journey 8 from a laptop, with the real client against the live portal and the sshd
fleet: milo signs in with a token, installs his ssh config into his home, runs a
command on every worker of tpu5 (a 4-worker pod), runs a JAX psum there from a working
directory (synced to every worker; on the second run only the changed file moves),
follows the logs to the end and gets each job's exit code; bad input is refused with
the portal's words; after Google moves a worker, any tpu command puts `ssh tpu5` back
in working order; a revoked token says to log in again.

The production way: the live server answers the client, a real Celery worker runs the
VM's passes, Celery beat polls the jobs, and the workers run real JAX (the CPU build)."""

from __future__ import annotations

import json
import queue
import re
import shlex
import signal
import stat
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import transaction

from accounts.keys import add_key
from accounts.services import create_token, revoke_token
from accounts.unix import choose_username
from testfleet.fixtures import add_fleet_node, give_lab_key
from tests.e2e import free_port
from tests.laptop import ClientLaptop, new_key
from tests.requirements import need
from tests.test_journey_access import worker_env  # noqa: F401 (a fixture)
from tests.test_journey_jobs import beat  # noqa: F401 (a fixture)
from tpus.services import inventory
from tpus.services.grants import grant_access
from tpus.tests.test_jobs_host import JAX_ENV, POD_PY

pytestmark = [pytest.mark.slow, pytest.mark.fleet]

PROJECT, ZONE = "vision-lab-1", "us-central1-f"
CLIENT = Path(__file__).resolve().parent.parent
# This Python with the client of this checkout, whichever copy it has installed.
PYTHON = ["env", f"PYTHONPATH={CLIENT}", sys.executable]
TPU = shlex.join([*PYTHON, "-m", "tpu_cli"])
XLA = "XLA_FLAGS=--xla_force_host_platform_device_count=4"


@dataclass
class Scene:
    laptop: ClientLaptop
    url: str
    token: str
    hosts: list
    username: str
    milo: object
    token_row: object

    def tpu(self, *args: str, timeout: float = 60, env: str = ""):
        """``tpu …`` at milo's home, as he would type it."""
        line = f"{env} {TPU} {shlex.join(args)}".strip()
        return self.laptop.run(["sh", "-c", line], cwd=self.laptop.real_home, timeout=timeout)


@pytest.fixture
def scene(
    worker_env, beat, live_server, tpu_emulator, fleet, fleet_hosts, fleet_username,  # noqa: F811
    make_lab, make_user, add_member, tmp_path,
) -> Scene:  # fmt: skip
    need(Path(JAX_ENV, "bin", "python").exists(), f"JAX's CPU build is not in {JAX_ENV}")
    need(Path(CLIENT, "tpu_cli").is_dir(), "the client's package is not in cli/")
    hosts = fleet_hosts(4)
    lab = make_lab("Vision Lab", slug="vision", gcp_project_id=PROJECT, zones=[ZONE])
    admin = make_user("boss@vision.example")
    add_member(lab, admin, role="admin")
    add_fleet_node(tpu_emulator.controls, fleet, hosts, PROJECT, ZONE, "tpu5")
    give_lab_key(fleet, hosts, lab)
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    milo = make_user("milo@uni.example")
    add_member(lab, milo)
    choose_username(milo, fleet_username)
    laptop = ClientLaptop(tmp_path / "home")
    add_key(milo, new_key(laptop))
    from portal.celery import app

    eager = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        [grant] = grant_access(admin, lab, milo, [vm], sudo=False)
    finally:
        app.conf.task_always_eager = eager
    grant.refresh_from_db()
    assert grant.state == "active", grant.error
    home = f"/home/{fleet_username}"
    for host in hosts:
        fleet.exec(host.name, ["sh", "-c", f"ln -sfn {JAX_ENV} {home}/jax && "
                               f"chown -h {fleet_username}: {home}/jax"])  # fmt: skip
    with transaction.atomic():
        row, token = create_token(milo, "laptop")
    return Scene(laptop, live_server.url, token, hosts, fleet_username, milo, row)


def _login(scene) -> None:
    _ok(scene.laptop.run(["sh", "-c", f"printf '%s\\n' {scene.token} | {TPU} login "
                          f"--with-token {scene.url}"], cwd=scene.laptop.real_home))  # fmt: skip


def _lines(stream) -> queue.Queue:
    found: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [found.put(line) for line in stream], daemon=True).start()
    return found


def _wait_for(lines: queue.Queue, text: str, timeout: float = 240) -> list:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if text in seen[-1]:
            return seen
    raise AssertionError(f"no {text!r} in {seen}")


def _fetch(url: str, timeout: float = 30) -> str:
    """What ``url`` answers, once something listens there."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
                return answer.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ok(result):
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result


def _shared(scene) -> Path:
    """The folder of milo's shared ssh connections, as the client finds it."""
    code = ("from tpu_cli import connections, sshfiles; "
            "argv = connections.shared(sshfiles.ssh_base(), 'tpu5'); "
            "print(next(a for a in argv if a.startswith('ControlPath=')))")  # fmt: skip
    found = _ok(scene.laptop.run([*PYTHON, "-c", code], cwd=scene.laptop.real_home))
    return Path(found.stdout.strip().removeprefix("ControlPath=")).parent


def _masters(scene, folder: Path) -> list[str]:
    """The sockets in ``folder`` whose connection ssh says is running."""
    running = []
    for socket in sorted(folder.iterdir()) if folder.exists() else []:
        check = scene.laptop.run(["ssh", "-o", f"ControlPath={socket}", "-O", "check", "x"])
        if check.returncode == 0:
            running.append(socket.name)
    return running


def test_milo_runs_his_code_on_every_worker_of_a_pod_from_his_laptop(scene, fleet, tpu_emulator):
    laptop = scene.laptop
    # Signing in with a pasted token; the sign-in is private to him.
    _ok(scene.laptop.run(["sh", "-c", f"printf '%s\\n' {scene.token} | {TPU} login "
                          f"--with-token {scene.url}"], cwd=laptop.real_home))  # fmt: skip
    saved = laptop.path("~/.config/tpu-portal/credentials.json")
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert json.loads(saved.read_text())["email"] == "milo@uni.example"

    # With $HOME elsewhere than his home in the password database (which OpenSSH reads,
    # and resolves a relative Include against), the client's ssh still finds every
    # worker, and he is told how plain ssh does.
    elsewhere = f"{laptop.real_home}/elsewhere"
    env = f"HOME={elsewhere} TPU_PORTAL_CONFIG_DIR={laptop.real_home}/.config/tpu-portal"
    installed = _ok(scene.tpu("config", "install", env=env))
    assert f"`ssh -F {elsewhere}/.ssh/config tpu5` works" in installed.stderr
    ran = _ok(scene.tpu("exec", "tpu5", "--worker", "all", "--", "id -un", env=env))
    assert ran.stdout.count(scene.username) == 4

    # The ssh config goes where the page says; plain ssh works, no prompt.
    laptop.path("~/.ssh/config").write_text("Host github.com\n    User git\n")
    installed = _ok(scene.tpu("config", "install"))
    assert "Now `ssh tpu5` works" in installed.stderr
    assert (
        laptop.path("~/.ssh/config")
        .read_text()
        .startswith(f"Include {laptop.real_home}/.ssh/config.d/*\n\nHost github")
    )
    assert laptop.path("~/.ssh/config.tpu-portal-backup").exists()
    assert stat.S_IMODE(laptop.path("~/.ssh/config.d/tpu-portal").stat().st_mode) == 0o600
    who = _ok(laptop.ssh("tpu5-w3", "id -un"))
    assert who.stdout.strip() == scene.username

    # podrun: every worker at once, each line after its worker.
    ran = _ok(scene.tpu("exec", "tpu5", "--worker", "all", "--", "hostname"))
    lines = ran.stdout.splitlines()
    assert sorted(line.split(" ")[0] for line in lines) == ["(w0)", "(w1)", "(w2)", "(w3)"]
    assert len({line.split(" ", 1)[1] for line in lines}) == 4, lines
    failed = scene.tpu("exec", "tpu5", "--", "test -e /nonexistent")
    assert failed.returncode == 1
    assert "Failed on 4 of 4 worker(s): w0 (exit 1)" in failed.stderr
    # One connection per worker, kept open for the next command, its socket private.
    shared = _shared(scene)
    assert len(_masters(scene, shared)) == 4
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700

    # A JAX psum across the pod, from a working directory synced to every worker.
    work = laptop.path("~/proj")
    (work / "data").mkdir(parents=True)
    (work / "pod.py").write_text(POD_PY)
    (work / ".gitignore").write_text("data/\n")
    (work / "data" / "big.bin").write_bytes(b"x" * 100_000)
    for n in range(20):
        (work / f"notes{n}.txt").write_text(f"note {n}\n")
    run = ["run", "tpu5", "--workdir", "proj", "--venv", "~/jax", "--env", XLA, "--",
           "python", "pod.py"]  # fmt: skip
    first = _ok(scene.tpu(*run, timeout=300, env="TPU_CLI_SHOW_SYNCED=1"))
    for index in range(4):
        assert f"(w{index}) process {index} devices 16 sum 120.0" in first.stdout, first
    assert "Synced" in first.stderr and "on 4 worker(s): 22 changed file(s)" in first.stderr
    assert re.search(r"Job \d+ succeeded", first.stderr)
    home = f"/home/{scene.username}"
    for host in scene.hosts:  # .gitignore kept the data out
        assert fleet.exec(host.name, ["test", "-e", f"{home}/proj/data/big.bin"],
                          check=False).returncode != 0  # fmt: skip
        assert fleet.exec(host.name, ["test", "-f", f"{home}/proj/notes7.txt"]).returncode == 0

    # One file changes: only it moves, to each worker once.
    (work / "notes7.txt").write_text("changed\n")
    second = _ok(scene.tpu(*run, timeout=300, env="TPU_CLI_SHOW_SYNCED=1"))
    sent = re.findall(r"\(w(\d)\) sent (\S+)", second.stderr)
    assert sorted(sent) == [(str(i), "notes7.txt") for i in range(4)], second.stderr
    assert "1 changed file(s)" in second.stderr
    assert "(w2) process 2 devices 16 sum 120.0" in second.stdout

    # The job's own exit code, and why.
    three = scene.tpu("run", "tpu5", "--venv", "~/jax", "--", "sh", "-c", "echo bye; exit 3",
                      timeout=180)  # fmt: skip
    assert three.returncode == 3, three
    assert "(w1) bye" in three.stdout and "failed (exit code 3)" in three.stderr

    # Bad input: the portal's own words, non-zero, nothing queued.
    refused = scene.tpu("run", "tpu5", "--env", "PATH=/tmp", "--", "true")
    assert refused.returncode == 2 and "PATH" in refused.stderr, refused
    unknown = scene.tpu("run", "tpu9", "--", "true")
    assert unknown.returncode == 4
    assert "You have no access to a TPU VM named tpu9. Yours: vision/tpu5." in unknown.stderr
    missing = scene.tpu("run", "tpu5", "--workdir", "nowhere", "--", "true")
    assert missing.returncode == 2 and "The workdir nowhere does not exist" in missing.stderr

    # Google moves worker 0; any tpu command refreshes the config, and ssh works again.
    from tpus.services.sync import sync_inventory

    new_ip = fleet.move(scene.hosts[0].name, fleet.free_ip())
    tpu_emulator.controls.set_ip("tpu5", 0, new_ip)
    sync_inventory()
    listed = _ok(scene.tpu("ls", "--json"))
    [row] = json.loads(listed.stdout)
    assert (row["vm"], row["lab"], row["address"], row["workers"]) == ("tpu5", "vision", new_ip, 4)
    assert "Updated your ssh config" in listed.stderr
    assert _ok(laptop.ssh("tpu5", "id -un")).stdout.strip() == scene.username
    # The connections made before the move are not used again: new ones, to the new address.
    moved = _ok(scene.tpu("exec", "tpu5", "--worker", "0", "--", "hostname -I"))
    assert new_ip in moved.stdout
    assert _shared(scene) != shared and len(_masters(scene, _shared(scene))) == 1

    # A revoked token: the client says to log in again.
    revoke_token(scene.milo, scene.token_row)
    ended = scene.tpu("ls")
    assert ended.returncode == 3
    assert f"Your sign-in to {scene.url} has ended; run `tpu login` again." in ended.stderr


def test_milo_syncs_through_worker_0_detaches_cancels_follows_again_and_signs_out(scene):
    from accounts.models import ApiToken
    from tpus.models import Job

    laptop, home = scene.laptop, scene.laptop.real_home
    _login(scene)
    _ok(scene.tpu("config", "install"))

    # --sync via-worker0: the laptop sends to worker 0, which sends to the others as
    # milo (his agent forwarded), checking their pinned host keys.
    work = laptop.path("~/proj2")
    work.mkdir()
    for n in range(5):
        (work / f"f{n}.txt").write_text(f"file {n} on every worker\n")
    line = (f"ssh-add -q ~/.ssh/id_ed25519 && {TPU} run tpu5 --workdir proj2 --sync via-worker0 "
            "--venv ~/jax -- cat f3.txt")  # fmt: skip
    relayed = _ok(laptop.run(["ssh-agent", "sh", "-c", line], cwd=home, timeout=240))
    for index in range(4):
        assert f"(w{index}) file 3 on every worker" in relayed.stdout, relayed
    assert "Synced from worker 0 to 3 worker(s): 15 file copies" in relayed.stderr

    # Ctrl-C detaches; the job goes on.
    follow = laptop.start([*PYTHON, "-m", "tpu_cli", "run", "tpu5", "--venv", "~/jax", "--",
                           "sh", "-c", "echo start; sleep 300"], cwd=home)  # fmt: skip
    # Both pipes are read as the client writes: a pipe nobody reads fills up and stalls it.
    told: list[str] = []
    reader = threading.Thread(target=lambda: told.extend(follow.stderr), daemon=True)
    reader.start()
    try:
        try:
            _wait_for(_lines(follow.stdout), "(w3) start")
        except AssertionError as missing:
            follow.kill()
            reader.join(timeout=10)
            jobs = list(Job.objects.order_by("pk").values("pk", "state", "reason"))
            raise AssertionError(f"{missing}\nclient: {''.join(told)}\njobs: {jobs}") from None
        follow.send_signal(signal.SIGINT)
        assert follow.wait(timeout=30) == 130
    finally:
        if follow.poll() is None:
            follow.kill()
    reader.join(timeout=30)
    said = "".join(told)
    number = re.search(r"Detached; job (\d+) goes on\. Follow it again: tpu logs -f \1", said)
    assert number, said
    job = Job.objects.get(pk=int(number.group(1)))
    assert job.state == "running"

    # Cancel it, follow it again to its end: the whole log, then the job's exit code,
    # that of a process killed by TERM (128 + 15), as the portal gives it.
    cancelled = _ok(scene.tpu("cancel", str(job.pk)))
    assert f"Job {job.pk} on vision/tpu5: cancel" in cancelled.stderr
    again = scene.tpu("logs", "-f", str(job.pk), timeout=120)
    assert again.returncode == 143 == Job.objects.get(pk=job.pk).exit_code, again
    assert "(w0) start" in again.stdout and f"Job {job.pk} cancelled" in again.stderr
    one = _ok(scene.tpu("logs", str(job.pk), "--worker", "2"))
    assert one.stdout == "start\n"
    listed = json.loads(_ok(scene.tpu("jobs", "tpu5", "--json")).stdout)
    assert {j["id"]: j["state"] for j in listed}[job.pk] == "cancelled"
    [report] = json.loads(_ok(scene.tpu("usage", "--json")).stdout)
    assert report["lab"] == "vision" and report["jobs"] >= 1

    # A port of worker 0 here, as the page's `ssh -N -L` line does.
    serve = "cd proj2 && (nohup python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 &)"
    _ok(scene.tpu("exec", "tpu5", "--worker", "0", "--", serve))
    local = free_port()
    tunnel = laptop.start([*PYTHON, "-m", "tpu_cli", "forward", "tpu5", f"8765:{local}"], cwd=home)
    try:
        assert _fetch(f"http://127.0.0.1:{local}/f0.txt") == "file 0 on every worker\n"
    finally:
        tunnel.send_signal(signal.SIGINT)
        tunnel.wait(timeout=30)
        scene.tpu("exec", "tpu5", "--worker", "0", "--", "pkill -f 'http.server 8765'")
    assert f"Forwarding http://localhost:{local} to port 8765 on tpu5" in tunnel.stderr.read()

    # Signing out revokes the token on the portal and forgets it here.
    shared = _shared(scene)
    assert len(_masters(scene, shared)) == 4
    gone = _ok(scene.tpu("logout"))
    assert "the token is revoked" in gone.stderr
    assert _masters(scene, shared) == []  # its connections closed
    assert ApiToken.objects.get(pk=scene.token_row.pk).revoked_at is not None
    assert not laptop.path("~/.config/tpu-portal/credentials.json").exists()
    assert scene.tpu("ls").returncode == 3

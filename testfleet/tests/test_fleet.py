"""The sshd fleet itself: isolation, moves, reboots, outages and a clean teardown."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from testfleet import Fleet, cgroups
from testfleet.system import list_links, list_netns, run

pytestmark = pytest.mark.fleet


def ssh(fleet, host, command: str, *, ip: str | None = None, timeout: int = 5):
    """Log in with Debian's OpenSSH client, trusting only the host's own keys."""
    known = fleet.state_dir / f"known_hosts-{host.name}"
    address = ip or host.ip
    known.write_text("".join(f"{address} {key}\n" for key in fleet.host_keys(host.name)))
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", str(fleet.admin_key_path), "-o", "BatchMode=yes",
         "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
         "-o", "StrictHostKeyChecking=yes", "-o", f"ConnectTimeout={timeout}",
         f"{fleet.admin_user}@{address}", command],
        capture_output=True, text=True, timeout=timeout + 10, check=False,
    )  # fmt: skip


def connects(ip: str, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((ip, 22), timeout=timeout).close()
        return True
    except OSError:
        return False


def test_a_user_added_over_ssh_exists_on_that_host_only(fleet, fleet_hosts, fleet_username):
    one, other = fleet_hosts(2)
    added = ssh(fleet, one, f"sudo -n useradd --create-home {fleet_username}")
    assert added.returncode == 0, added.stderr
    assert fleet.exec(one.name, ["getent", "passwd", fleet_username]).returncode == 0
    assert fleet.exec(other.name, ["getent", "passwd", fleet_username], check=False).returncode
    assert fleet_username not in Path("/etc/passwd").read_text()
    assert fleet_username not in Path("/etc/shadow").read_text()
    assert not Path("/home", fleet_username).exists()


def test_the_admin_logs_in_with_the_fleet_key_and_has_passwordless_sudo(fleet, fleet_host):
    answer = ssh(fleet, fleet_host, "hostname; sudo -n id -u")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.split() == [fleet_host.hostname, "0"]


def test_hosts_cannot_see_the_work_tree_the_admin_key_or_the_fleet_state(fleet, fleet_host):
    repo = Path(__file__).resolve().parents[2]
    look = fleet.exec(
        fleet_host.name,
        ["sh", "-c", f"ls -A /work /root {repo} {fleet.state_dir.parent} /tmp 2>/dev/null; "
                     f"cat {fleet.admin_key_path} 2>/dev/null; true"],
    )  # fmt: skip
    listing = look.stdout.decode()
    assert "PRIVATE KEY" not in listing
    assert "manage.py" not in listing
    assert "state.json" not in listing


def test_each_host_has_its_own_host_keys_of_three_types(fleet, fleet_hosts):
    one, other = fleet_hosts(2)
    keys = fleet.host_keys(one.name)
    assert [k.split()[0] for k in keys] == ["ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"]
    assert not set(keys) & set(fleet.host_keys(other.name))


def test_a_moved_host_answers_on_its_new_address_only(fleet, fleet_host):
    old = fleet_host.ip
    new = fleet.move(fleet_host.name)
    assert new != old and fleet_host.ip == new
    assert ssh(fleet, fleet_host, "true").returncode == 0
    assert not connects(old)
    listed = fleet.exec(fleet_host.name, ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
    assert new.encode() in listed and old.encode() not in listed


def test_a_host_has_no_route_out_of_the_fleet_subnet(fleet, fleet_host):
    routes = fleet.exec(fleet_host.name, ["ip", "route", "show"]).stdout.decode()
    assert "default" not in routes
    assert routes.split()[0] == str(fleet.network)


def test_reboot_kills_every_process_of_the_host_and_changes_its_boot_id(fleet, fleet_host):
    started = ssh(fleet, fleet_host, "nohup sleep 600 >/dev/null 2>&1 & echo started")
    assert started.stdout.strip() == "started"
    before = run(["ip", "netns", "pids", fleet_host.netns]).stdout.split()
    assert len(before) >= 2  # sshd and the sleep
    old_boot = fleet.exec(fleet_host.name, ["cat", "/proc/sys/kernel/random/boot_id"]).stdout

    new_boot = fleet.reboot(fleet_host.name)

    assert fleet.exec(fleet_host.name, ["pgrep", "-x", "sleep"], check=False).returncode == 1
    for pid in before:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    seen = fleet.exec(fleet_host.name, ["cat", "/proc/sys/kernel/random/boot_id"]).stdout
    assert seen.decode().strip() == new_boot != old_boot.decode().strip()
    assert ssh(fleet, fleet_host, "true").returncode == 0


def test_a_hosts_processes_run_in_its_own_cgroups_mounted_where_a_worker_has_them(
    fleet, fleet_host
):
    dirs = fleet.host(fleet_host.name).cgroups["dirs"]
    assert str(fleet_host.init.pid) in Path(dirs["unified"], "init", "cgroup.procs").read_text()
    inside = fleet.exec(fleet_host.name, ["sh", "-c", "grep cgroup /proc/self/mountinfo"])
    points = {line.split()[4]: line.split(" - ")[1].split()[0] for line in
              inside.stdout.decode().splitlines()}  # fmt: skip
    expected = {"/sys/fs/cgroup/unified": "cgroup2"} if "pids" in dirs else {}
    expected |= {f"/sys/fs/cgroup/{kind}": "cgroup" for kind in ("pids", "memory") if kind in dirs}
    assert expected.items() <= points.items() or points.get("/sys/fs/cgroup") == "cgroup2"
    # What the host makes there is the fleet's directory's; a reboot removes it.
    mount = "/sys/fs/cgroup/unified" if "pids" in dirs else "/sys/fs/cgroup"
    fleet.exec(fleet_host.name, ["mkdir", "-p", f"{mount}/tpu-portal/job-x"])
    below = Path(dirs["unified"], "tpu-portal", "job-x")
    assert below.is_dir()
    fleet.reboot(fleet_host.name)
    assert not below.exists()
    dirs = fleet.host(fleet_host.name).cgroups["dirs"]
    assert Path(dirs["unified"], "init").is_dir()


def _is_zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_host_taken_down_hangs_connects_until_it_comes_back(fleet, fleet_host):
    fleet.down(fleet_host.name)
    started = time.monotonic()
    assert not connects(fleet_host.ip, timeout=1.0)
    assert time.monotonic() - started >= 0.9  # hung until our timeout, like a dead VM
    fleet.start(fleet_host.name)
    assert connects(fleet_host.ip)


def test_a_host_taken_down_unreachable_fails_fast(fleet, fleet_host):
    fleet.down(fleet_host.name, hang=False)
    started = time.monotonic()
    assert not connects(fleet_host.ip, timeout=10)
    assert time.monotonic() - started < 8
    fleet.start(fleet_host.name)
    assert connects(fleet_host.ip)


def _session(fleet, host) -> subprocess.Popen:
    """An SSH connection to ``host`` that stays open (a minute's ``sleep``)."""
    known = fleet.state_dir / f"known_hosts-{host.name}"
    known.write_text("".join(f"{host.ip} {key}\n" for key in fleet.host_keys(host.name)))
    session = subprocess.Popen(
        ["ssh", "-F", "/dev/null", "-i", str(fleet.admin_key_path), "-o", "BatchMode=yes",
         "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
         "-o", "StrictHostKeyChecking=yes", f"{fleet.admin_user}@{host.ip}",
         "echo open; exec sleep 60"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert session.stdout.readline() == "open\n"
    return session


def test_healing_a_host_that_was_cut_off_ends_its_connections_and_only_then(fleet, fleet_hosts):
    """What a client sent a cut-off host is sent again once it is back: healed between
    tests, its connections end, so none of it arrives in the next test."""
    cut, kept = fleet_hosts(2)
    sessions = {cut.name: _session(fleet, cut), kept.name: _session(fleet, kept)}
    try:
        fleet.down(cut.name)
        fleet.start(cut.name)
        time.sleep(1)
        assert sessions[cut.name].poll() is None  # back on the network, still open
        fleet.heal(cut.name)
        fleet.heal(kept.name)
        assert sessions[cut.name].wait(timeout=10) == 255
        assert sessions[kept.name].poll() is None  # never cut off: left alone
        assert ssh(fleet, cut, "true").returncode == 0  # sshd still listens
    finally:
        for session in sessions.values():
            session.kill()
            session.wait()


def test_teardown_leaves_no_namespace_link_mount_process_or_file(fleet):
    other = Fleet.open_free(first=fleet.slot + 1)
    try:
        hosts = other.up(3)
        pids = [p for h in hosts for p in (h.init, h.launcher)]
        netns = [h.netns for h in hosts]
        inner = [int(p) for ns in netns for p in run(["ip", "netns", "pids", ns]).stdout.split()]
        assert all(os.path.exists(f"/proc/{p.pid}") for p in pids)
        groups = [d for h in hosts for d in h.cgroups["dirs"].values()]
        assert groups and all(os.path.isdir(d) for d in groups)
    finally:
        state_dir, name, bridge = other.state_dir, other.name, other.bridge
        other.destroy()
    assert not [d for d in groups if os.path.exists(d)]
    assert not [ns for ns in list_netns() if ns.startswith(f"{name}-")]
    assert not [link for link in list_links() if link.startswith(name)]
    assert bridge not in list_links()
    mounts = Path("/proc/mounts").read_text()
    assert str(state_dir) not in mounts and f"/run/netns/{name}-" not in mounts
    assert not state_dir.exists()
    for pid in [p.pid for p in pids] + inner:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(str(pid))


def test_the_next_run_removes_what_a_crashed_run_left(fleet):
    crashed = Fleet.open_free(first=fleet.slot + 1)
    slot = crashed.slot
    hosts = crashed.up(2)
    crashed.close()  # the process "dies": nothing torn down, the lock released
    groups = [d for h in hosts for d in h.cgroups["dirs"].values()]
    # A host whose record is lost too: its cgroups are found by their names.
    stray = cgroups.create(f"tf{slot}", "h9")
    assert stray is not None

    again = Fleet.open(slot)
    assert set(again.hosts) == {h.name for h in hosts}
    again.destroy()
    assert not [d for d in [*groups, *stray.dirs.values()] if os.path.exists(d)]
    assert not [ns for ns in list_netns() if ns.startswith(f"tf{slot}-")]
    assert f"tf{slot}br" not in list_links()
    for host in hosts:
        assert not os.path.exists(f"/proc/{host.init.pid}") or _is_zombie(str(host.init.pid))


def test_a_stopped_fleet_comes_back_with_its_addresses_host_keys_and_homes(fleet):
    other = Fleet.open_free(first=fleet.slot + 1)
    try:
        [host] = other.up(1)
        keys, ip, boot = other.host_keys(host.name), host.ip, host.boot_id
        other.exec(host.name, ["useradd", "-m", "-u", "41999", "kept"])
        other.exec(host.name, ["sh", "-c", "echo mine > /home/kept/notes"])
        old_init = host.init

        other.stop()
        assert not host.running and not os.path.exists(f"/proc/{old_init.pid}/exe")
        assert not connects(ip)
        [again] = other.up(1)

        assert again.ip == ip and again.boot_id != boot
        assert other.host_keys(again.name) == keys
        found = ssh(other, again, "cat /home/kept/notes; getent passwd kept | cut -d: -f3")
        assert found.stdout == "mine\n41999\n", found
    finally:
        other.destroy()

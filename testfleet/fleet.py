"""A fleet of real sshd hosts on this machine, one network namespace each.

Every host is PID 1 (sshd) of its own PID, mount, UTS and IPC namespace inside its own
network namespace, with a veth into a bridge in the machine's namespace. The bridge
holds the first address of the fleet's private subnet and is the only way in; hosts
have no default route, so nothing they send leaves the bridge.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Address, IPv4Network, ip_address
from pathlib import Path

from testfleet import cgroups, hostfs, slots
from testfleet.network import FleetNetwork
from testfleet.system import (
    FleetError,
    Pid,
    alive,
    children_of,
    kill,
    listening_on,
    pid_of,
    run,
    wait_gone,
)

_INIT_SCRIPT = (Path(__file__).with_name("host-init.sh")).read_text()
_GUEST_AGENT_SCRIPT = (Path(__file__).with_name("guest-agent.sh")).read_text()
_REPO = Path(__file__).resolve().parent.parent
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT = 20.0
# Writes its own pid into each cgroup.procs file given before "--", then runs the rest.
_JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ >"$1" || exit 1; shift; done; shift; exec "$@"'


@dataclass
class Host:
    """One sshd "TPU VM worker" of the fleet, as recorded in the state file."""

    name: str
    index: int
    ip: str
    netns: str
    veth: str
    hostname: str
    boot_id: str = ""
    down: bool = False
    # The host's own cgroups while it runs (testfleet/cgroups.py): HostCgroups.to_json().
    cgroups: dict | None = field(default=None, repr=False)
    launcher: Pid | None = field(default=None, repr=False)
    init: Pid | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        data = asdict(self)
        data["launcher"] = self.launcher.to_json() if self.launcher else None
        data["init"] = self.init.to_json() if self.init else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> Host:
        data = dict(data)
        data["launcher"] = Pid.from_json(data.get("launcher"))
        data["init"] = Pid.from_json(data.get("init"))
        return cls(**data)

    @property
    def running(self) -> bool:
        return alive(self.init)


class Fleet:
    """A fleet in one slot. Open it with ``Fleet.open(slot)``; it holds the slot's lock
    until ``close()``. All state lives in ``state_dir`` so another process (or the next
    run, after a crash) can pick it up and tear it down."""

    def __init__(self, lock: slots.SlotLock, *, network: str | None = None):
        self._lock = lock
        self.slot = lock.slot
        self.name = f"tf{lock.slot}"
        self.state_dir = lock.root / f"slot-{lock.slot}"
        self.network: IPv4Network = slots.slot_network(lock.slot, network)
        self.bridge = f"{self.name}br"
        self.bridge_ip = str(self.network[1])
        self.net = FleetNetwork(self.name, self.bridge, self.bridge_ip, self.network.prefixlen)
        self.admin_key_path = self.state_dir / "admin_ed25519"
        self.hosts: dict[str, Host] = {}
        self.admin: hostfs.AdminAccount | None = None
        self._popen: dict[int, subprocess.Popen] = {}
        # Hosts cut off since they were last healed (this process's own record).
        self._cut_off: set[str] = set()
        self._load()

    # --- opening, state ---------------------------------------------------------------

    @classmethod
    def open(cls, slot: int = 0, root: Path | None = None, *, network: str | None = None):
        """Claim ``slot`` (SlotBusy if another process has it) and load its state."""
        return cls(slots.SlotLock(root or slots.root_dir(), slot), network=network)

    @classmethod
    def open_free(cls, root: Path | None = None, first: int = 1, *, network: str | None = None):
        """Claim the first free slot from ``first`` up."""
        return cls(slots.claim_free_slot(root or slots.root_dir(), first), network=network)

    def close(self) -> None:
        self._reap()
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def _load(self) -> None:
        try:
            data = json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return
        self.hosts = {h["name"]: Host.from_json(h) for h in data.get("hosts", [])}
        if data.get("admin"):
            self.admin = hostfs.AdminAccount(**data["admin"])

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "name": self.name,
            "network": str(self.network),
            "bridge": self.bridge,
            "admin": asdict(self.admin) if self.admin else None,
            "hosts": [h.to_json() for h in self.hosts.values()],
        }
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self._state_file)

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise FleetError(f"no host {name!r} in fleet {self.name}") from None

    def host_dir(self, name: str) -> Path:
        return self.state_dir / "hosts" / name

    @property
    def admin_public_key(self) -> str:
        return self.admin_key_path.with_suffix(".pub").read_text().strip()

    @property
    def admin_user(self) -> str:
        return self.admin.name if self.admin else "admin"

    # --- starting -----------------------------------------------------------------

    def up(self, count: int) -> list[Host]:
        """Make sure hosts h1..h<count> exist and run; returns them in order."""
        if self.hosts and not self.net.exists():
            self.teardown()  # state from before a machine restart: nothing of it is left
        fresh = not self.hosts
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        if fresh:
            self.net.remove()  # leftovers of a run whose state file is gone
            self.net.create_bridge()
        if not self.admin_key_path.exists():
            hostfs.write_keypair(self.admin_key_path, "ed25519", f"portal-admin@{self.name}")
        if self.admin is None:
            self.admin = hostfs.AdminAccount.choose()

        new = []
        used = {h.ip for h in self.hosts.values()}
        for index in range(1, count + 1):
            name = f"h{index}"
            if name in self.hosts:
                continue
            ip = str(self.network[10 + index])
            if ip in used:
                ip = self.free_ip()
            used.add(ip)
            netns = f"{self.name}-{name}"
            host = Host(name, index, ip, netns=netns, veth=f"{self.name}v{index}", hostname=netns)
            self.hosts[name] = host
            new.append(host)
        self._save()  # record names before creating anything, so a crash can be undone

        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
            jobs = [
                pool.submit(hostfs.generate_host_key, self.host_dir(h.name), kind, h.hostname)
                for h in new
                for kind in hostfs.HOST_KEY_TYPES
            ]
            for host in new:
                hostfs.prepare(
                    self.host_dir(host.name),
                    host.hostname,
                    host.ip,
                    self.admin,
                    self.admin_public_key,
                )
            self.net.plug_in([(h.netns, h.veth, h.ip) for h in new])
            for job in jobs:
                job.result()

        wanted = [h for h in self.hosts.values() if int(h.name[1:]) <= count]
        self._launch([h for h in wanted if not h.running])
        return wanted

    def _hidden_paths(self) -> list[str]:
        """Folders of the machine each host sees as empty: work trees, keys, state."""
        paths = ["/work", str(_REPO), str(self._lock.root), "/mnt", "/srv"]
        paths += [p for p in os.environ.get("TESTFLEET_HIDE", "").split(":") if p]
        seen: list[str] = []
        for path in paths:
            path = os.path.abspath(path)
            if path not in seen and path not in ("/", "/etc", "/var", "/home", "/root"):
                seen.append(path)
        return seen

    def _launch(self, hosts: list[Host]) -> None:
        """Start each host's PID 1 and wait until every sshd listens."""
        hidden = self._hidden_paths()
        env = {"PATH": _PATH, "LANG": "C.UTF-8"}
        for h in hosts:
            host_dir = self.host_dir(h.name)
            h.boot_id = hostfs.new_boot_id(host_dir)
            join = self._host_cgroups(h)
            args = [
                *join,
                "ip",
                "netns",
                "exec",
                h.netns,
                "unshare",
                "--pid",
                "--fork",
                "--mount",
                "--uts",
                "--ipc",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                "-c",
                _INIT_SCRIPT,
                "testfleet-init",
                str(host_dir),
                h.hostname,
                str(chips_per_host()),
                *hidden,
            ]
            with open(host_dir / "sshd.log", "ab") as log:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            self._popen[proc.pid] = proc
            h.launcher = pid_of(proc.pid)
            h.init = None
        self._save()

        pending = {h.launcher.pid: h for h in hosts if h.launcher}
        deadline = time.monotonic() + START_TIMEOUT
        while pending:
            for parent, child in children_of(set(pending)).items():
                host = pending[parent]
                if host.init is None:
                    host.init = pid_of(child)
            for parent, host in list(pending.items()):
                if host.init and _is_sshd(host.init.pid) and listening_on(host.init.pid, 22):
                    del pending[parent]
                elif not alive(host.launcher):
                    self._save()
                    raise FleetError(f"host {host.name} did not start:\n{self.log(host.name)}")
            if pending and time.monotonic() > deadline:
                self._save()
                names = ", ".join(h.name for h in pending.values())
                raise FleetError(f"hosts did not start in {START_TIMEOUT:.0f} s: {names}")
            time.sleep(0.01)
        self._save()

    def _host_cgroups(self, host: Host) -> list[str]:
        """Make the host's cgroups and tell host-init.sh where they are; the command
        prefix that puts the host's first process (so all of them) into them."""
        self._remove_cgroups(host)  # a boot starts with no cgroups of the last one
        made = cgroups.create(self.name, host.name)
        layout = self.host_dir(host.name) / "cgroups"
        if made is None:
            layout.unlink(missing_ok=True)
            host.cgroups = None
            return []
        host.cgroups = made.to_json()
        self._save()  # recorded before anything runs in them, so teardown finds them
        layout.write_text(made.layout())
        return ["/bin/sh", "-c", _JOIN_CGROUPS, "testfleet-join", *made.procs_files, "--"]

    def _remove_cgroups(self, host: Host) -> None:
        """A host's cgroups go with its processes, as a worker's go at a reboot."""
        recorded = cgroups.HostCgroups.from_json(host.cgroups)
        if recorded is not None:
            cgroups.remove(recorded.dirs.values())
        host.cgroups = None

    def _reap(self) -> None:
        for pid, proc in list(self._popen.items()):
            if proc.poll() is not None:
                del self._popen[pid]

    # --- controls -----------------------------------------------------------------

    def free_ip(self) -> str:
        """An address of the fleet's subnet that no host uses (from the upper half)."""
        used = {h.ip for h in self.hosts.values()}
        start = self.network.num_addresses // 2 + 10
        for offset in range(start, self.network.num_addresses - 1):
            candidate = str(self.network[offset])
            if candidate not in used:
                return candidate
        raise FleetError(f"no free address left in {self.network}")

    def move(self, name: str, new_ip: str | None = None) -> str:
        """Give a host another address of the fleet's subnet, as when Google changes a
        TPU VM's IP. Open connections to the old address break."""
        host = self.host(name)
        new_ip = new_ip or self.free_ip()
        address = ip_address(new_ip)
        if not isinstance(address, IPv4Address) or address not in self.network:
            raise FleetError(f"{new_ip} is not in the fleet's subnet {self.network}")
        if address in (self.network.network_address, self.network.broadcast_address) or (
            new_ip == self.bridge_ip
        ):
            raise FleetError(f"{new_ip} is reserved in {self.network}")
        if any(h.ip == new_ip for h in self.hosts.values() if h is not host):
            raise FleetError(f"{new_ip} belongs to another host")
        self.net.readdress(host.netns, host.ip, new_ip)
        host.ip = new_ip
        hostfs.write_hosts(self.host_dir(name), host.hostname, new_ip)
        self._save()
        return new_ip

    def reboot(self, name: str) -> str:
        """Kill every process of the host, then boot it again with a new boot id."""
        host = self.host(name)
        self._stop(host)
        self._launch([host])
        return host.boot_id

    def rekey(self, name: str) -> list[str]:
        """New host keys (as when a TPU VM is recreated), then a reboot to use them."""
        host = self.host(name)
        for kind in hostfs.HOST_KEY_TYPES:
            hostfs.generate_host_key(self.host_dir(name), kind, host.hostname)
        self.reboot(name)
        return self.host_keys(name)

    def renew(self, name: str) -> list[str]:
        """The host becomes a new machine at the same address, as when Google makes a
        TPU VM anew: its /etc and /var layers and homes are emptied (the fleet's admin
        account only), it gets new host keys and boots again. Returns the new keys."""
        host = self.host(name)
        self._stop(host)
        host_dir = self.host_dir(name)
        for sub in ("etc", "etc.work", "var", "var.work", "home", "root"):
            shutil.rmtree(host_dir / sub, ignore_errors=True)
        hostfs.prepare(host_dir, host.hostname, host.ip, self.admin, self.admin_public_key)
        for kind in hostfs.HOST_KEY_TYPES:
            hostfs.generate_host_key(host_dir, kind, host.hostname)
        self._launch([host])
        return self.host_keys(name)

    def _stop(self, host: Host) -> None:
        kill(host.init)
        wait_gone([host.init])
        kill(host.launcher)
        wait_gone([host.launcher])
        host.init = host.launcher = None
        self._reap()
        self._remove_cgroups(host)
        self._save()

    def stop(self) -> None:
        """Stop every host (all its processes) but keep the fleet: addresses, network,
        host keys, /etc and homes stay, and the next ``up`` boots the same hosts again,
        as a TPU VM that was stopped and started keeps its disk and keys."""
        for host in self.hosts.values():
            if host.init or host.launcher:
                self._stop(host)

    def down(self, name: str, *, hang: bool = True) -> None:
        """Take a host off the network. With ``hang`` (a dead cloud VM) the bridge keeps
        a pinned neighbour entry, so connects hang until the client's timeout; without
        it they fail after a few seconds with "No route to host"."""
        host = self.host(name)
        self.net.cut(host.netns, host.veth, host.ip, hang=hang)
        host.down = True
        self._cut_off.add(name)
        self._save()

    def start(self, name: str) -> None:
        """Bring a host back onto the network (and boot it if it is not running)."""
        host = self.host(name)
        self.net.reconnect(host.veth, host.ip)
        host.down = False
        self._save()
        if not host.running:
            self._launch([host])

    def heal(self, name: str) -> Host:
        """Whatever a test did to a host, make it run and be reachable again. A host
        that was cut off since it was last healed has its SSH connections ended: what a
        client sent while the host could not hear it (a script and its input, to a
        shell the portal keeps open) is still in that client's kernel, which sends it
        again once the host is back. Arriving later, in the next test, it would run
        there, with the state of a test that is over."""
        host = self.host(name)
        if host.down or not host.running:
            self.start(name)
        if name in self._cut_off:
            self.end_connections(name)
            self._cut_off.discard(name)
        return host

    def end_connections(self, name: str) -> None:
        """Close every SSH connection the host has open; its sshd, the host's first
        process, goes on listening. (A connection is two sshd processes, a privileged
        one and the session's; either keeps it open.)"""
        self.exec(name, ["/bin/sh", "-c", (
            'for pid in $(pgrep -x sshd); do [ "$pid" = 1 ] || kill -KILL "$pid"; done; :'
        )], check=False)  # fmt: skip

    def exec(
        self,
        name: str,
        args: list[str],
        *,
        input: bytes | None = None,
        check: bool = True,
        timeout: float = 30,
    ) -> subprocess.CompletedProcess:
        """Run a command as root inside the host's namespaces (its /etc, /home, pids)."""
        host = self.host(name)
        if not host.running:
            raise FleetError(f"host {name} is not running")
        cmd = [
            "nsenter",
            "-t",
            str(host.init.pid),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-w",
            "--",
            "env",
            "-i",
            f"PATH={_PATH}",
            "HOME=/root",
            "LANG=C.UTF-8",
            *args,
        ]
        return run(cmd, input=input, check=check, timeout=timeout)

    def set_ssh_keys(self, name: str, keys: dict[str, list[str]]) -> None:
        """Apply ``{account: [public key lines]}`` to a host the way Google's guest
        agent applies a node's ``ssh-keys`` metadata (see guest-agent.sh): accounts
        with passwordless sudo and exactly these keys; accounts no longer listed lose
        their keys."""
        records = []
        for user, lines in sorted(keys.items()):
            records.append(f"user {user}")
            records += [f"key {user} {' '.join(line.split()[:3])}" for line in lines]
        data = "".join(f"{record}\n" for record in records).encode()
        self.exec(name, ["/bin/sh", "-c", _GUEST_AGENT_SCRIPT, "guest-agent"], input=data)

    def host_keys(self, name: str) -> list[str]:
        """The host's public keys as ``"<type> <base64>"``, like guest attributes give."""
        self.host(name)
        return hostfs.host_keys(self.host_dir(name))

    def log(self, name: str) -> str:
        """What the host's sshd has logged so far (every boot)."""
        path = self.host_dir(name) / "sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def status(self) -> list[dict]:
        rows = []
        for h in self.hosts.values():
            state = "down" if h.down else "up"
            if not h.running:
                state = "stopped"
            rows.append(
                {
                    "name": h.name,
                    "ip": h.ip,
                    "state": state,
                    "boot_id": h.boot_id,
                    "pid": h.init.pid if h.init else None,
                    "netns": h.netns,
                }
            )
        return rows

    # --- tearing down -------------------------------------------------------------

    def teardown(self) -> None:
        """Remove everything this slot made: processes (by recorded pid, and those in
        the slot's own network namespaces), namespaces, veths, bridge, state files."""
        hosts = list(self.hosts.values())
        for h in hosts:
            kill(h.init)
        wait_gone([h.init for h in hosts])
        for h in hosts:
            kill(h.launcher)
        wait_gone([h.launcher for h in hosts])
        self._reap()
        for h in hosts:
            self._remove_cgroups(h)
        cgroups.remove(cgroups.leftovers(self.name))  # from a run whose state is gone

        self.net.remove()

        self.hosts = {}
        self.admin = None
        hostfs.remove(self.state_dir)

    def destroy(self) -> None:
        """Tear down and give the slot back, removing its lock file too."""
        self.teardown()
        self._lock.release(remove=True)


def chips_per_host() -> int:
    """Fake TPU chips per host (``/dev/accel0`` …): ``TESTFLEET_CHIPS``, default 4 as on
    a v4 worker."""
    value = os.environ.get("TESTFLEET_CHIPS", "4")
    if not value.isdigit() or int(value) > 64:
        raise FleetError(f"TESTFLEET_CHIPS must be a number of chips 0..64, not {value!r}")
    return int(value)


def _is_sshd(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe") == "/usr/sbin/sshd"
    except OSError:
        return False

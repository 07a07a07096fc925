"""The fleet's network: a bridge in the machine's namespace, and per host a network
namespace whose ``eth0`` is a veth into that bridge. Hosts get no default route."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from testfleet.system import ip_batch, kill, list_links, list_netns, pid_of, run, wait_gone


@dataclass(frozen=True)
class FleetNetwork:
    """The plumbing of one fleet: ``bridge`` holds ``gateway``/``prefixlen``; host
    namespaces are named ``<prefix>-h<N>`` and their veths ``<prefix>v<N>``."""

    prefix: str
    bridge: str
    gateway: str
    prefixlen: int

    def exists(self) -> bool:
        return self.bridge in list_links()

    def create_bridge(self) -> None:
        ip_batch(
            [
                f"link add {self.bridge} type bridge",
                f"addr add {self.gateway}/{self.prefixlen} dev {self.bridge}",
                f"link set {self.bridge} up",
            ]
        )
        Path(f"/proc/sys/net/ipv6/conf/{self.bridge}/disable_ipv6").write_text("1")

    def plug_in(self, hosts: list[tuple[str, str, str]]) -> None:
        """Create a namespace and veth for each (netns, veth, ip); one ``ip`` process for
        the machine's side, one per namespace for the inside."""
        lines = []
        for netns, veth, _ in hosts:
            lines += [
                f"netns add {netns}",
                f"link add {veth} type veth peer name eth0 netns {netns}",
                f"link set {veth} master {self.bridge}",
                f"link set {veth} up",
            ]
        ip_batch(lines)
        for netns, _, ip in hosts:
            inside = ["link set lo up", f"addr add {ip}/{self.prefixlen} dev eth0"]
            ip_batch([*inside, "link set eth0 up"], netns=netns)

    def readdress(self, netns: str, old: str, new: str) -> None:
        # Delete first: removing a primary address also removes its secondaries.
        ip_batch(
            [
                f"addr del {old}/{self.prefixlen} dev eth0",
                f"addr add {new}/{self.prefixlen} dev eth0",
            ],
            netns=netns,
        )
        self._forget(old, new)

    def cut(self, netns: str, veth: str, ip: str, *, hang: bool) -> None:
        """Take the veth down. With ``hang`` the bridge keeps a pinned neighbour entry,
        so packets still go out and vanish: connects hang (a dead cloud VM). Without it
        ARP fails and connects end in "No route to host" after a few seconds."""
        lines = [f"link set {veth} down"]
        if hang:
            mac = json.loads(run(["ip", "-n", netns, "-j", "link", "show", "dev", "eth0"]).stdout)
            lines.append(
                f"neigh replace {ip} lladdr {mac[0]['address']} dev {self.bridge} nud permanent"
            )
        ip_batch(lines)
        if not hang:
            self._forget(ip)

    def reconnect(self, veth: str, ip: str) -> None:
        ip_batch([f"link set {veth} up"])
        self._forget(ip)

    def _forget(self, *ips: str) -> None:
        ip_batch([f"neigh del {ip} dev {self.bridge}" for ip in ips], force=True)

    def remove(self) -> None:
        """Kill what still runs in our namespaces, delete veths, namespaces, bridge."""
        ours = [ns for ns in list_netns() if ns.startswith(f"{self.prefix}-h")]
        for ns in ours:
            pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
            procs = [pid_of(int(p)) for p in pids]
            for proc in procs:
                kill(proc)
            wait_gone(procs)
        links = list_links()
        lines = [f"link del {link}" for link in links if self._is_our_veth(link)]
        lines += [f"netns del {ns}" for ns in ours]
        if self.bridge in links:
            lines.append(f"link del {self.bridge}")
        ip_batch(lines, force=True)

    def _is_our_veth(self, link: str) -> bool:
        rest = link.removeprefix(f"{self.prefix}v")
        return rest != link and rest.isdigit()

"""The ssh config and known_hosts, written by the client from what the portal says of
the person's hosts (``/me/ssh-hosts``: names, addresses, host key aliases, pinned
keys, port forwards), never copied from text the portal sends. Every value is checked
to be of its expected form first; one that is not is refused, naming it, and nothing
is written: a portal (or whoever answers as one) can change where ``ssh tpu5`` goes,
but cannot add a ``ProxyCommand``, a ``Host *`` or a ``Match`` to the person's ssh."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpu_cli.errors import UNREACHABLE, CliError

# A unix username (the portal's own rule is stricter: ^[a-z][a-z0-9-]{0,30}$).
_USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# A lab slug, a VM name, a zone: letters, digits, '-' and '_' (no dot, no space, no
# wildcard); what the portal's names are made of.
_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
# A Cloud TPU zone, as the portal takes them (us-central1-f, europe-west4-a).
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
# A host name the person types: words joined by '.' or '-' (tpu5, vision-tpu5,
# tpu5.us-central1-f.vision).
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*$")


def host_forms(lab: str, name: str, zone: str) -> set[str]:
    """The names the portal gives a VM's worker 0 (the VM's name, with its lab in front
    when two labs have one of that name, its zone after when one lab has it in two, or
    ``name.zone.lab``): none can be another host the person reaches (github.com)."""
    return {name, f"{lab}-{name}", f"{name}-{zone}", f"{lab}-{name}-{zone}",
            f"{name}.{zone}.{lab}"}  # fmt: skip


_KEY_TYPES = frozenset({
    "ssh-ed25519", "ssh-rsa", "ssh-dss", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com",
})  # fmt: skip
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")
MAX_WORKERS = 4096


class Refused(CliError):
    """What the portal sent is not of the form an ssh config is made of."""

    def __init__(self, what: str, value: Any):
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(
            f"The portal sent {what} that is not valid: {shown}. Nothing was written to your "
            "ssh files; tell the portal's admins.",
            UNREACHABLE,
        )


@dataclass(frozen=True)
class Built:
    config: str
    known_hosts: str


def _text(value: Any, pattern: re.Pattern, what: str, *, longest: int = 253) -> str:
    if not isinstance(value, str) or len(value) > longest or not pattern.match(value):
        raise Refused(what, value)
    return value


def _int(value: Any, lowest: int, highest: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= highest:
        raise Refused(what, value)
    return value


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise Refused(what, value)
    return value


def _address(value: Any, what: str) -> str:
    """An IPv4 or IPv6 address, as ``ipaddress`` writes it."""
    if not isinstance(value, str):
        raise Refused(what, value)
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise Refused(what, value) from None


def host_key(value: Any, what: str) -> str:
    """``type base64`` of a public host key whose blob says the same type."""
    if not isinstance(value, str) or len(value) > 16384:
        raise Refused(what, value)
    kind, _, blob = value.partition(" ")
    if kind not in _KEY_TYPES or not _BASE64.match(blob) or len(blob) % 4:
        raise Refused(what, value)
    try:
        raw = base64.b64decode(blob, validate=True)
    except binascii.Error:
        raise Refused(what, value) from None
    if len(raw) < 4:
        raise Refused(what, value)
    (length,) = struct.unpack(">I", raw[:4])
    if raw[4 : 4 + length] != kind.encode():
        raise Refused(what, value)
    return value


def quoted(path: Path, *, tokens: bool = True) -> str:
    """A path as an ssh config argument: quoted when it has a space, ``%`` doubled for
    an option that takes ssh's % tokens (``UserKnownHostsFile``; ``Include`` takes none)."""
    text = str(path)
    if any(ch in text for ch in '"\n\r\t\\'):
        raise CliError(f"The path {text!r} cannot be written into an ssh config.", 2)
    if tokens:
        text = text.replace("%", "%%")
    return f'"{text}"' if " " in text else text


def _vm_blocks(vm: Any, username: str, known: str, seen: set) -> tuple[list, list]:
    """The ``Host`` blocks and known_hosts lines of one VM of the portal's answer."""
    if not isinstance(vm, dict):
        raise Refused("a VM", vm)
    lab = _text(vm.get("lab"), _WORD, "a lab name")
    name = _text(vm.get("name"), _WORD, "a VM name")
    zone = _text(vm.get("zone"), _ZONE, f"the zone of {lab}/{name}")
    host = _text(vm.get("host"), _HOST, f"the host name of {lab}/{name}")
    if host not in host_forms(lab, name, zone):
        raise Refused(f"the host name of {lab}/{name}", host)
    agent = vm.get("forward_agent")
    if not isinstance(agent, bool):
        raise Refused(f"the agent forwarding of {lab}/{name}", agent)
    forwards = []
    for forward in _list(vm.get("forwards"), f"the port forwards of {lab}/{name}"):
        if not isinstance(forward, dict):
            raise Refused(f"a port forward of {lab}/{name}", forward)
        local = _int(forward.get("local"), 1, 65535, f"a local port of {lab}/{name}")
        remote = _int(forward.get("remote"), 1, 65535, f"a port of {lab}/{name}")
        forwards.append((local, remote))
    workers = _list(vm.get("workers"), f"the workers of {lab}/{name}")
    if len(workers) > MAX_WORKERS:
        raise Refused(f"the workers of {lab}/{name}", f"{len(workers)} workers")
    pod = len(workers) > 1
    blocks, lines = [], []
    for worker in workers:
        if not isinstance(worker, dict):
            raise Refused(f"a worker of {lab}/{name}", worker)
        index = _int(worker.get("index"), 0, MAX_WORKERS - 1, f"a worker index of {lab}/{name}")
        alias = worker.get("alias")
        # The portal's alias: tpu-portal.<lab>.<name>[.<zone>].w<index>, the same for as
        # long as the VM lives, so the pinned keys survive an address change.
        if alias not in (f"tpu-portal.{lab}.{name}.w{index}",
                         f"tpu-portal.{lab}.{name}.{zone}.w{index}"):  # fmt: skip
            raise Refused(f"the host key alias of {lab}/{name} worker {index}", alias)
        if alias in seen:
            raise Refused("a host key alias twice", alias)
        seen.add(alias)
        keys = _list(worker.get("host_keys"), f"the host keys of {alias}")
        lines += [f"{alias} {host_key(key, f'a host key of {alias}')}" for key in keys]
        if worker.get("address") is None:
            continue
        address = _address(worker["address"], f"the address of {alias}")
        names = ([host] if index == 0 else []) + ([f"{host}-w{index}"] if pod else [])
        for each in names:
            if each in seen:  # vm tpu5-w1 beside pod tpu5's worker 1: ssh takes the first
                continue
            seen.add(each)
            block = [
                f"Host {each}",
                f"    HostName {address}",
                f"    User {username}",
                f"    HostKeyAlias {alias}",
                f"    UserKnownHostsFile {known}",
                "    StrictHostKeyChecking yes",
                f"    ForwardAgent {'yes' if agent else 'no'}",
            ]
            if each == host:
                block += [
                    f"    LocalForward {local} localhost:{remote}" for local, remote in forwards
                ]
            if not blocks:
                block.insert(0, f"# {name} (lab {lab}, zone {zone})")
            blocks.append("\n".join(block))
    return blocks, lines


def build(answer: Any, portal: str, known_hosts_file: Path) -> Built:
    """The config and known_hosts from ``/me/ssh-hosts``; ``Refused`` for anything that
    is not of its expected form."""
    if not isinstance(answer, dict):
        raise Refused("an answer about your ssh hosts", answer)
    if any(ord(ch) < 0x20 or ch == "\x7f" for ch in portal):
        raise CliError(f"The portal's address {portal!r} has a control character.", 2)
    known = quoted(known_hosts_file)
    header = [
        f"# TPU Portal ssh hosts from {portal}, written by the tpu client (every tpu",
        "# command rewrites this file when an address or host key changes).",
        f"# Their pinned host keys are in {known}.",
        "",
    ]
    if answer.get("username") is None:
        header.insert(0, "# Choose your unix username on the portal first; no host until then.")
        return Built("\n".join(header) + "\n", "")
    username = _text(answer.get("username"), _USERNAME, "a unix username")
    blocks, lines, seen = [], [], set()
    for vm in _list(answer.get("vms"), "the list of your VMs"):
        more_blocks, more_lines = _vm_blocks(vm, username, known, seen)
        blocks += more_blocks
        lines += more_lines
    config = "\n".join(header) + "\n" + ("\n\n".join(blocks) + "\n" if blocks else "")
    return Built(config, "".join(line + "\n" for line in lines))

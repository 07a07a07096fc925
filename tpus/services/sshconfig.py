"""The ssh config and known_hosts a collaborator keeps for their TPU VMs.

Each worker gets a stable ``HostKeyAlias``, so its pinned host key stays valid when
Google changes the VM's external IP: only ``HostName`` changes, and plain
``ssh tpu5`` keeps working with ``StrictHostKeyChecking yes`` and no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from tpus.models import Grant, TpuVm
from tpus.models.grants import WANTED_STATES

CONFIG_PATH = "~/.ssh/config.d/tpu-portal"
KNOWN_HOSTS_PATH = "~/.ssh/tpu-portal_known_hosts"


@dataclass(frozen=True)
class HostEntry:
    host: str  # what the collaborator types: tpu5, tpu5-w1
    hostname: str  # the worker's current external IP
    alias: str  # the stable HostKeyAlias
    host_keys: tuple[str, ...]


def key_alias(vm: TpuVm, index: int) -> str:
    return f"tpu-portal.{vm.lab.slug}.{vm.name}.w{index}"


def _host_names(vms: list[TpuVm]) -> dict[int, str]:
    """``tpu5``, or ``<lab>-tpu5`` when two of the person's labs both have a tpu5."""
    counts: dict[str, int] = {}
    for vm in vms:
        counts[vm.name] = counts.get(vm.name, 0) + 1
    return {vm.pk: vm.name if counts[vm.name] == 1 else f"{vm.lab.slug}-{vm.name}" for vm in vms}


def entries_for(vms: list[TpuVm]) -> list[tuple[HostEntry, TpuVm]]:
    """One entry per reachable worker: ``tpu5`` is worker 0, and a pod's workers are
    also ``tpu5-w0`` … ``tpu5-w3``."""
    names = _host_names(vms)
    entries = []
    for vm in vms:
        workers = sorted(vm.workers.all(), key=lambda w: w.index)
        pod = len(workers) > 1
        for worker in workers:
            if not worker.external_ip:
                continue
            keys, alias = tuple(worker.host_keys), key_alias(vm, worker.index)
            if worker.index == 0:
                entries.append((HostEntry(names[vm.pk], worker.external_ip, alias, keys), vm))
            if pod:
                host = f"{names[vm.pk]}-w{worker.index}"
                entries.append((HostEntry(host, worker.external_ip, alias, keys), vm))
    return entries


def vms_for(user) -> list[TpuVm]:
    """The VMs a person can log in to now (or will, once the hosts catch up)."""
    grants = Grant.objects.filter(user=user, state__in=WANTED_STATES)
    return list(
        TpuVm.objects.filter(grants__in=grants)
        .select_related("lab")
        .prefetch_related("workers")
        .order_by("name", "lab__slug")
    )


def _forward_agent(user, vm: TpuVm) -> bool:
    return bool(vm.lab.default_agent_forwarding)


def render_config(user, vms: list[TpuVm] | None = None) -> str:
    vms = vms_for(user) if vms is None else vms
    username = user.unix_account.username
    lines = [
        f"# TPU Portal ssh config for {username}, generated {timezone.now():%Y-%m-%d %H:%M} UTC.",
        f"# Keep it in {CONFIG_PATH} with `Include config.d/*` at the top of ~/.ssh/config,",
        f"# and the host keys in {KNOWN_HOSTS_PATH}. Regenerated whenever an IP changes.",
        "",
    ]
    for entry, vm in entries_for(vms):
        lines += [
            f"Host {entry.host}",
            f"    HostName {entry.hostname}",
            f"    User {username}",
            f"    HostKeyAlias {entry.alias}",
            f"    UserKnownHostsFile {KNOWN_HOSTS_PATH}",
            "    StrictHostKeyChecking yes",
            f"    ForwardAgent {'yes' if _forward_agent(user, vm) else 'no'}",
            "",
        ]
    return "\n".join(lines)


def render_known_hosts(vms: list[TpuVm]) -> str:
    lines = []
    for vm in vms:
        for worker in sorted(vm.workers.all(), key=lambda w: w.index):
            for key in worker.host_keys:
                lines.append(f"{key_alias(vm, worker.index)} {key}")
    return "\n".join(lines) + ("\n" if lines else "")


def snippet_for(user, vms: list[TpuVm]) -> str:
    """The short form for an email or a copy button: one block per host."""
    account = getattr(user, "unix_account", None)
    username = account.username if account else "<your unix username>"
    blocks = []
    for entry, vm in entries_for(vms):
        blocks.append(
            "\n".join(
                [
                    f"Host {entry.host}",
                    f"    HostName {entry.hostname}",
                    f"    User {username}",
                    f"    HostKeyAlias {entry.alias}",
                    f"    ForwardAgent {'yes' if _forward_agent(user, vm) else 'no'}",
                ]
            )
        )
    return "\n\n".join(blocks)

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


def forward_agent(user, vm: TpuVm) -> bool:
    """The person's own choice, else the lab's default."""
    feed = getattr(user, "config_feed", None) if hasattr(user, "pk") else None
    if feed is not None and feed.forward_agent is not None:
        return feed.forward_agent
    return bool(vm.lab.default_agent_forwarding)


def render_config(user, vms: list[TpuVm] | None = None) -> str:
    account = getattr(user, "unix_account", None)
    if account is None or not account.username:
        return "# Choose your unix username on the portal first; this file is empty until then.\n"
    vms = vms_for(user) if vms is None else vms
    username = account.username
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
            f"    ForwardAgent {'yes' if forward_agent(user, vm) else 'no'}",
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
    username = account.username if account and account.username else "<your unix username>"
    blocks = []
    for entry, vm in entries_for(vms):
        blocks.append(
            "\n".join(
                [
                    f"Host {entry.host}",
                    f"    HostName {entry.hostname}",
                    f"    User {username}",
                    f"    HostKeyAlias {entry.alias}",
                    f"    ForwardAgent {'yes' if forward_agent(user, vm) else 'no'}",
                ]
            )
        )
    return "\n\n".join(blocks)


# --- The refresh URL ------------------------------------------------------------------


def _token(feed) -> str:
    from django.utils.crypto import salted_hmac

    return (
        f"{feed.user_id}-" + salted_hmac("tpu-portal.ssh-config-feed", feed.salt).hexdigest()[:40]
    )


def feed_for(user, *, create: bool = True):
    import secrets

    from tpus.models import ConfigFeed

    feed = ConfigFeed.objects.filter(user=user).first()
    if feed is None and create:
        feed, _ = ConfigFeed.objects.get_or_create(
            user=user, defaults={"salt": secrets.token_hex(16)}
        )
    return feed


def rotate_feed(user):
    """A new URL; the old one stops working at once."""
    import secrets

    feed = feed_for(user)
    feed.salt = secrets.token_hex(16)
    feed.enabled = True
    feed.save(update_fields=["salt", "enabled"])
    return feed


def disable_feed(user) -> None:
    from tpus.models import ConfigFeed

    ConfigFeed.objects.filter(user=user).update(enabled=False)


def user_for_token(token: str):
    """The active person a refresh URL belongs to, or None."""
    from django.utils.crypto import constant_time_compare

    from tpus.models import ConfigFeed

    user_id, _, _ = (token or "").partition("-")
    if not user_id.isdigit() or len(token) > 80:
        return None
    feed = (
        ConfigFeed.objects.select_related("user").filter(user_id=int(user_id), enabled=True).first()
    )
    if feed is None or not feed.user.is_active or not constant_time_compare(_token(feed), token):
        return None
    return feed.user


def feed_urls(user) -> dict[str, str] | None:
    from django.conf import settings
    from django.urls import reverse

    feed = feed_for(user, create=False)
    if feed is None or not feed.enabled:
        return None
    token = _token(feed)
    return {
        "config": settings.SITE_URL + reverse("ssh_feed_config", args=[token]),
        "known_hosts": settings.SITE_URL + reverse("ssh_feed_known_hosts", args=[token]),
    }


def refresh_command(user) -> str:
    """The line to run (or put in cron) that keeps both files current."""
    urls = feed_urls(user)
    if urls is None:
        return ""
    return (
        f"curl -fsS {urls['config']} -o {CONFIG_PATH} && "
        f"curl -fsS {urls['known_hosts']} -o {KNOWN_HOSTS_PATH}"
    )

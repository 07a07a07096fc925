"""The ssh config and known_hosts a collaborator keeps for their TPU VMs.

Each worker gets a stable ``HostKeyAlias``, so its pinned host key stays valid when
Google changes the VM's external IP: only ``HostName`` changes, and plain
``ssh tpu5`` keeps working with ``StrictHostKeyChecking yes`` and no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import Prefetch
from django.utils import timezone

from tpus.models import Grant, PortForward, TpuVm, Worker
from tpus.models.grants import WANTED_STATES

CONFIG_PATH = "~/.ssh/config.d/tpu-portal"
KNOWN_HOSTS_PATH = "~/.ssh/tpu-portal_known_hosts"


@dataclass(frozen=True)
class HostEntry:
    host: str  # what the collaborator types: tpu5, tpu5-w1
    hostname: str  # the worker's current external IP
    alias: str  # the stable HostKeyAlias
    host_keys: tuple[str, ...]
    main: bool = False  # the VM's own name (worker 0), where its port forwards go


@dataclass(frozen=True)
class VmNames:
    host: str  # what the collaborator types for worker 0
    alias_prefix: str  # the HostKeyAlias without the worker suffix

    def alias(self, index: int) -> str:
        return f"{self.alias_prefix}.w{index}"


def names_for(vms: list[TpuVm]) -> dict[int, VmNames]:
    """The ``Host`` name and ``HostKeyAlias`` of each of one person's VMs, unique among
    them and the same every time for the same set of VMs.

    A VM whose name is unique among the person's VMs is ``tpu5`` with alias
    ``tpu-portal.<lab>.tpu5``, as always, so existing configs do not change. When two
    labs both have a tpu5, the host names get the lab in front (``<lab>-tpu5``); when
    one lab has a tpu5 in two zones, the zone goes after the name (``tpu5-us-central1-f``)
    and into the alias. A generated name that clashes with another VM's own name (which
    that VM keeps) falls back to ``tpu5.<zone>.<lab>``, which cannot clash: VM names, zones and lab
    slugs contain no dots, and a lab has one VM per name and zone.
    """
    by_name: dict[str, list[TpuVm]] = {}
    for vm in vms:
        by_name.setdefault(vm.name, []).append(vm)
    names: dict[int, VmNames] = {}
    for name, group in by_name.items():
        many_labs = len({vm.lab_id for vm in group}) > 1
        per_lab: dict[int, int] = {}
        for vm in group:
            per_lab[vm.lab_id] = per_lab.get(vm.lab_id, 0) + 1
        for vm in group:
            in_zones = per_lab[vm.lab_id] > 1
            host = f"{vm.lab.slug}-{name}" if many_labs else name
            alias = f"tpu-portal.{vm.lab.slug}.{name}"
            if in_zones:
                host, alias = f"{host}-{vm.zone}", f"{alias}.{vm.zone}"
            names[vm.pk] = VmNames(host, alias)
    taken: dict[str, int] = {}
    for entry in names.values():
        taken[entry.host] = taken.get(entry.host, 0) + 1
    for vm in vms:
        host = names[vm.pk].host
        if taken[host] > 1 and host != vm.name:
            names[vm.pk] = VmNames(f"{vm.name}.{vm.zone}.{vm.lab.slug}", names[vm.pk].alias_prefix)
    return names


def entries_for(
    vms: list[TpuVm], among: list[TpuVm] | None = None
) -> list[tuple[HostEntry, TpuVm]]:
    """One entry per reachable worker: ``tpu5`` is worker 0, and a pod's workers are
    also ``tpu5-w0`` … ``tpu5-w3``. Names are made unique over ``among`` (all of the
    person's VMs; by default just ``vms``)."""
    names = names_for(merged(vms, among))
    entries = []
    for vm in vms:
        workers = sorted(vm.workers.all(), key=lambda w: w.index)
        pod = len(workers) > 1
        vm_names = names[vm.pk]
        for worker in workers:
            if not worker.external_ip:
                continue
            keys, alias = tuple(worker.host_keys), vm_names.alias(worker.index)
            if worker.index == 0:
                main = HostEntry(vm_names.host, worker.external_ip, alias, keys, main=True)
                entries.append((main, vm))
            if pod:
                host = f"{vm_names.host}-w{worker.index}"
                entries.append((HostEntry(host, worker.external_ip, alias, keys), vm))
    return entries


def merged(vms: list[TpuVm], among: list[TpuVm] | None) -> list[TpuVm]:
    """``among`` and whichever of ``vms`` it lacks: the set names are made unique over."""
    if among is None:
        return list(vms)
    seen = {vm.pk for vm in among}
    return [*among, *(vm for vm in vms if vm.pk not in seen)]


def host_name_for(user, vm: TpuVm, *, among: list[TpuVm] | None = None) -> str:
    """What the person types for the VM's worker 0 (``tpu5``, or ``vision-tpu5`` …);
    ``among``: the person's ``naming_peers`` when already read."""
    peers = naming_peers(user) if among is None else among
    return names_for(merged([vm], peers))[vm.pk].host


def naming_peers(user) -> list[TpuVm]:
    """The VMs whose names a person's host names must not clash with (no workers)."""
    mine = Grant.objects.filter(user=user, state__in=WANTED_STATES).values("vm_id")
    return list(
        TpuVm.objects.filter(pk__in=mine).select_related("lab").only("name", "zone", "lab__slug")
    )


# What the config, known_hosts and the ssh page read of a VM, its lab and its workers:
# every config download and refresh loads all of a person's VMs, so nothing more.
_VM_COLUMNS = ("name", "zone", "lab__slug", "lab__name")
_WORKER_COLUMNS = ("vm_id", "index", "external_ip", "host_keys")


def vms_for(user) -> list[TpuVm]:
    """The VMs a person can log in to now (or will, once the hosts catch up), with
    just the columns the config is made of."""
    grants = Grant.objects.filter(user=user, state__in=WANTED_STATES)
    return list(
        TpuVm.objects.filter(grants__in=grants)
        .select_related("lab")
        .only(*_VM_COLUMNS)
        .prefetch_related(Prefetch("workers", queryset=Worker.objects.only(*_WORKER_COLUMNS)))
        .order_by("name", "lab__slug")
    )


def feed_of(user):
    """The person's refresh URL row (``ConfigFeed``), or None: read once per user
    object, so the page and every ``forward_agent`` share one query."""
    return getattr(user, "config_feed", None) if hasattr(user, "pk") else None


def forward_agent(user, vm: TpuVm) -> bool:
    """Whether the person's agent is forwarded to ``vm``: only when they turned it on
    themselves. Anyone with sudo on the VM can use a forwarded agent while they are
    logged in, so it is each person's own opt-in; a lab has no say."""
    feed = feed_of(user)
    return feed is not None and feed.forward_agent is True


def forwards_for(user, vms: list[TpuVm]) -> dict[int, list[tuple[int, int]]]:
    """The person's chosen port forwards, ``{vm id: [(local, remote), …]}``, in one query."""
    if not getattr(user, "pk", None) or not vms:
        return {}
    found: dict[int, list[tuple[int, int]]] = {}
    rows = PortForward.objects.filter(user=user, vm__in=vms).order_by("local_port")
    for vm_id, local, remote in rows.values_list("vm_id", "local_port", "remote_port"):
        found.setdefault(vm_id, []).append((local, remote))
    return found


def host_blocks(
    user,
    vms: list[TpuVm],
    *,
    among: list[TpuVm] | None = None,
    forwards: dict[int, list[tuple[int, int]]] | None = None,
) -> str:
    """The ``Host`` blocks of ``vms``, line for line as in the person's downloaded
    config: the page shows them, the emails carry them, and the config is a header and
    them. Names are unique over ``among`` (all the person's VMs; looked up when not
    given); ``forwards`` are the person's (``forwards_for``; looked up when not given).

    Every block needs the pinned keys in ``KNOWN_HOSTS_PATH`` (strict checking, no
    prompt). Without them ssh says only "No … host key is known for tpu-portal.…", so a
    comment over each VM's blocks names the file, and goes wherever the lines are
    pasted. Comments hold only names the portal validated (a lab's display name could
    hold a line break, and so a config line of its own).
    """
    account = getattr(user, "unix_account", None)
    username = account.username if account and account.username else "<your unix username>"
    if among is None:
        among = naming_peers(user) if getattr(user, "pk", None) else []
    if forwards is None:
        forwards = forwards_for(user, vms)
    blocks, commented = [], set()
    for entry, vm in entries_for(vms, among):
        lines = []
        if vm.pk not in commented:
            commented.add(vm.pk)
            lines.append(
                f"# {vm.name} (lab {vm.lab.slug}) needs its host keys in {KNOWN_HOSTS_PATH},"
                f" from {settings.SITE_URL}/ssh/"
            )
        lines += [
            f"Host {entry.host}",
            f"    HostName {entry.hostname}",
            f"    User {username}",
            f"    HostKeyAlias {entry.alias}",
            f"    UserKnownHostsFile {KNOWN_HOSTS_PATH}",
            "    StrictHostKeyChecking yes",
            f"    ForwardAgent {'yes' if forward_agent(user, vm) else 'no'}",
        ]
        if entry.main:
            lines += [
                f"    LocalForward {local} localhost:{remote}"
                for local, remote in forwards.get(vm.pk, [])
            ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def render_config(user, vms: list[TpuVm] | None = None) -> str:
    """The whole file: where it and the host keys go, then every VM's blocks."""
    account = getattr(user, "unix_account", None)
    if account is None or not account.username:
        return "# Choose your unix username on the portal first; this file is empty until then.\n"
    vms = vms_for(user) if vms is None else vms
    generated = f"{timezone.now():%Y-%m-%d %H:%M} UTC"
    header = [
        f"# TPU Portal ssh config for {account.username}, generated {generated}.",
        f"# Regenerated whenever an IP changes; both files are on {settings.SITE_URL}/ssh/",
        f"# Save this file as {CONFIG_PATH}, with `Include config.d/*`",
        "# at the top of ~/.ssh/config, and the host keys (the known_hosts download)",
        f"# as {KNOWN_HOSTS_PATH}. Without them, ssh stops with",
        '# "No ... host key is known for tpu-portal..." and "Host key verification failed".',
        "",
    ]
    blocks = host_blocks(user, vms, among=vms)
    return "\n".join(header) + "\n" + (blocks + "\n" if blocks else "")


def hosts_for(user) -> dict:
    """What the config and known_hosts are made of, as data for a client that writes
    them itself (``tpu``): the unix username, and per VM its names, the person's port
    forwards and agent choice, and each worker's address, ``HostKeyAlias`` and pinned
    keys. Worker 0 is ``host``; on a pod every worker is also ``<host>-w<index>``."""
    account = getattr(user, "unix_account", None)
    username = account.username if account and account.username else None
    vms = vms_for(user) if username else []
    names = names_for(vms)
    forwards = forwards_for(user, vms)
    return {
        "username": username,
        "vms": [
            {
                "lab": vm.lab.slug,
                "name": vm.name,
                "zone": vm.zone,
                "host": names[vm.pk].host,
                "forward_agent": forward_agent(user, vm),
                "forwards": [
                    {"local": local, "remote": remote} for local, remote in forwards.get(vm.pk, [])
                ],
                "workers": [
                    {
                        "index": worker.index,
                        "address": worker.external_ip or None,
                        "alias": names[vm.pk].alias(worker.index),
                        "host_keys": list(worker.host_keys),
                    }
                    for worker in sorted(vm.workers.all(), key=lambda w: w.index)
                ],
            }
            for vm in vms
        ],
    }


def render_known_hosts(vms: list[TpuVm], *, among: list[TpuVm] | None = None) -> str:
    """One line per pinned key, under the stable alias (names unique over ``among``)."""
    names = names_for(merged(vms, among))
    lines = []
    for vm in vms:
        for worker in sorted(vm.workers.all(), key=lambda w: w.index):
            for key in worker.host_keys:
                lines.append(f"{names[vm.pk].alias(worker.index)} {key}")
    return "\n".join(lines) + ("\n" if lines else "")


def snippet_for(
    user,
    vms: list[TpuVm],
    *,
    among: list[TpuVm] | None = None,
    forwards: dict[int, list[tuple[int, int]]] | None = None,
) -> str:
    """What the page and the emails show: the same blocks as the downloaded config."""
    return host_blocks(user, vms, among=among, forwards=forwards)


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
    return _urls_of(feed_for(user, create=False))


def _urls_of(feed) -> dict[str, str] | None:
    from django.urls import reverse

    if feed is None or not feed.enabled:
        return None
    token = _token(feed)
    return {
        "config": settings.SITE_URL + reverse("ssh_feed_config", args=[token]),
        "known_hosts": settings.SITE_URL + reverse("ssh_feed_known_hosts", args=[token]),
    }


def refresh_command(feed) -> str:
    """The line to run (or put in cron) that keeps both files current: empty without
    a refresh URL (``feed``, the person's ``feed_of``, missing or turned off)."""
    urls = _urls_of(feed)
    if urls is None:
        return ""
    return (
        f"curl -fsS {urls['config']} -o {CONFIG_PATH} && "
        f"curl -fsS {urls['known_hosts']} -o {KNOWN_HOSTS_PATH}"
    )

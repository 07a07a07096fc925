"""The TPU VMs the person may use, from the portal (grants, and per lab what holds
each VM now) and from their ssh config (host names, addresses); a VM named on the
command line (``tpu5`` or ``lab/tpu5``) resolved to one of them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tpu_cli import sshfiles
from tpu_cli.errors import NOT_FOUND, USAGE, CliError


@dataclass
class Vm:
    id: int
    name: str
    lab: str
    zone: str
    access: str  # the grant's state: active, pending, failed, revoking
    workers: int
    state: str = ""  # the Cloud TPU API's: READY, PREEMPTED, STOPPED …
    internal_ips: dict[int, str] = field(default_factory=dict)  # worker index -> address
    now: dict = field(default_factory=dict)  # the lab's usage "now" row: free/running/held
    # The accelerator type of the lab's grant of every VM of a kind that gave this one;
    # "" for access given on the VM itself.
    from_kind: str = ""
    # Its accelerator type (v4-8), the kind a job for the lab's pool names; "" from a
    # portal that does not say.
    accelerator_type: str = ""
    ssh: sshfiles.SshVm | None = None

    @property
    def label(self) -> str:
        return f"{self.lab}/{self.name}"

    @property
    def api_path(self) -> str:
        return f"/labs/{self.lab}/vms/{self.id}"

    def hosts(self) -> dict[int, str]:
        """Worker index -> the ssh host name for it (``tpu5``; ``tpu5-w0`` … on a pod)."""
        if self.ssh is None or not self.ssh.hosts:
            raise CliError(
                f"{self.label} has no workers with an address in your ssh config yet "
                "(the portal lists no external IP, or your unix username is not chosen).",
                USAGE,
            )
        return dict(sorted(self.ssh.hosts.items()))


def from_config(configured: list[sshfiles.SshVm]) -> list[Vm]:
    """The VMs in the person's ssh config, for what needs only ssh (``tpu exec``,
    ``tpu forward``): no further question to the portal."""
    return [
        Vm(id=0, name=c.name, lab=c.lab, zone=c.zone or "", access="active",
           workers=len(c.hosts), ssh=c)
        for c in configured
    ]  # fmt: skip


def my_vms(api, before_match=None, *, now: bool = False) -> list[Vm]:
    """Every VM the person holds a grant on (not revoked), from their grants alone
    (each names its lab, zone, state and workers); with ``now``, also what holds each
    TPU now (one question per lab). ``before_match`` runs before the ssh config is
    read (a refresh to wait for)."""
    grants = [g for g in api.pages("/me/grants") if g["state"] != "revoked"]
    found: dict[int, dict] = {}
    labs = sorted({g["lab"] for g in grants})
    if now and labs:
        with ThreadPoolExecutor(max_workers=4) as pool:
            rows = pool.map(lambda slug: list(api.pages(f"/labs/{slug}/usage/now")), labs)
            for row in (row for some in rows for row in some):
                found[row["vm_id"]] = row
    if before_match is not None:
        before_match()
    if not grants:
        return []
    configured = sshfiles.read_config()
    vms = []
    for grant in grants:
        vm = Vm(
            id=grant["vm_id"],
            name=grant["vm"],
            lab=grant["lab"],
            zone=grant["zone"],
            access=grant["state"],
            workers=grant["workers_total"],
            state=grant["vm_state"],
            internal_ips={w["index"]: w["internal_ip"] for w in grant["vm_workers"]
                          if w["internal_ip"]},
            now=found.get(grant["vm_id"], {}),
            from_kind=str(grant.get("from_kind") or ""),
            accelerator_type=str(grant.get("accelerator_type") or ""),
        )  # fmt: skip
        vm.ssh = _match(vm, configured)
        vms.append(vm)
    return sorted(vms, key=lambda v: (v.name, v.lab))


def _match(vm: Vm, configured: list[sshfiles.SshVm]) -> sshfiles.SshVm | None:
    candidates = [c for c in configured if c.lab == vm.lab and c.name == vm.name]
    if len(candidates) > 1:
        candidates = [c for c in candidates if c.zone == vm.zone]
    return candidates[0] if len(candidates) == 1 else None


def resolve(vms: list[Vm], wanted: str, *, need_active: bool = True) -> Vm:
    """The one VM ``wanted`` names: ``tpu5``, ``lab/tpu5`` or its ssh host name."""
    lab, _, name = wanted.rpartition("/")
    matches = [v for v in vms if v.name == name and (not lab or v.lab == lab)]
    if not matches and not lab:
        matches = [v for v in vms if v.ssh is not None and v.ssh.main == name]
    if not matches:
        mine = ", ".join(v.label for v in vms) or "none"
        raise CliError(f"You have no access to a TPU VM named {wanted}. Yours: {mine}.", NOT_FOUND)
    if len(matches) > 1:
        choices = ", ".join(v.label for v in matches)
        raise CliError(f"{wanted} is in more than one lab; say which: {choices}.", USAGE)
    vm = matches[0]
    if need_active and vm.access != "active":
        raise CliError(
            f"Your access to {vm.label} is {vm.access}, not active yet; `tpu ls` shows it.",
            NOT_FOUND,
        )
    return vm


def queue_position(api, vm: Vm, email: str) -> int | None:
    """The place of the person's first waiting job in the VM's queue (1: next)."""
    if not vm.now.get("queue_length"):
        return None
    waiting = []
    for state in ("queued", "blocked"):
        waiting += list(api.pages(f"{vm.api_path}/jobs", state=state))
    waiting.sort(key=lambda job: (job["queued_at"], job["id"]))
    for place, job in enumerate(waiting, 1):
        if job["user"].lower() == email.lower():
            return place
    return None

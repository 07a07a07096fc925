"""Ports on a TPU VM that a person reaches from their own machine (TensorBoard,
Jupyter): the one-off ``ssh -N -L`` line, and the ``LocalForward`` lines kept in that
VM's Host block of their ssh config."""

from __future__ import annotations

import re

from django.db import IntegrityError, transaction

from tpus.models import PortForward, TpuVm
from tpus.models.network import FORWARD_PORT_MAX, FORWARD_PORT_MIN
from tpus.services import sshconfig

MAX_FORWARDS_PER_VM = 10
_DIGITS = re.compile(r"[0-9]{1,5}")


class ForwardError(ValueError):
    """Input the person can fix; the message says how."""


def parse_port(value, which: str) -> int:
    """A port from a form: digits only (no signs, decimals or other scripts' digits),
    from 1024 to 65535. ``which`` is "local" or "remote", for the message."""
    text = str(value if value is not None else "").strip()
    if not text:
        raise ForwardError(f"Enter the {which} port, a whole number from 1024 to 65535.")
    if not _DIGITS.fullmatch(text):
        raise ForwardError(
            f"The {which} port must be a whole number from 1024 to 65535, not “{text[:20]}”."
        )
    port = int(text)
    if not FORWARD_PORT_MIN <= port <= FORWARD_PORT_MAX:
        raise ForwardError(
            f"The {which} port must be from {FORWARD_PORT_MIN} to {FORWARD_PORT_MAX}, not {port}:"
            " lower ports are reserved for the system."
        )
    return port


def _ports(local, remote) -> tuple[int, int]:
    return parse_port(local, "local"), parse_port(remote, "remote")


def _clash_message(host: str, local: int, taken_remote: int) -> str:
    return (
        f"Local port {local} is already forwarded to port {taken_remote} on {host} in your"
        f" ssh config; pick another local port, or remove that forward first."
    )


def tunnel_command(user, vm: TpuVm, local, remote) -> str:
    """The line that forwards ``localhost:local`` to port ``remote`` on the VM (worker
    0) for as long as it runs. A local port the VM's Host block already forwards would
    fail to bind, so it is refused here too."""
    local, remote = _ports(local, remote)
    host = sshconfig.host_name_for(user, vm)
    taken = PortForward.objects.filter(user=user, vm=vm, local_port=local).first()
    if taken is not None and taken.remote_port == remote:
        raise ForwardError(
            f"Your ssh config already forwards local port {local} to port {remote} on {host}:"
            f" plain `ssh -N {host}` opens it."
        )
    if taken is not None:
        raise ForwardError(_clash_message(host, local, taken.remote_port))
    return f"ssh -N -L {local}:localhost:{remote} {host}"


def add_forward(user, vm: TpuVm, local, remote) -> PortForward:
    """Keep ``LocalForward local localhost:remote`` in the VM's Host block. Asking for
    the same forward again is success; another forward of the same local port is not."""
    local, remote = _ports(local, remote)
    host = sshconfig.host_name_for(user, vm)
    with transaction.atomic():
        mine = PortForward.objects.filter(user=user, vm=vm)
        taken = mine.filter(local_port=local).first()
        if taken is not None and taken.remote_port == remote:
            return taken
        if taken is not None:
            raise ForwardError(_clash_message(host, local, taken.remote_port))
        if mine.count() >= MAX_FORWARDS_PER_VM:
            raise ForwardError(
                f"You keep {MAX_FORWARDS_PER_VM} forwards for {host} already; remove one first."
            )
        try:
            with transaction.atomic():
                return PortForward.objects.create(
                    user=user, vm=vm, local_port=local, remote_port=remote
                )
        except IntegrityError:  # the same local port, added by a request in between
            taken = mine.get(local_port=local)
            if taken.remote_port == remote:
                return taken
            raise ForwardError(_clash_message(host, local, taken.remote_port)) from None


def remove_forward(user, vm: TpuVm, local) -> None:
    """Drop the forward of ``local`` from the VM's Host block; already gone is success."""
    PortForward.objects.filter(user=user, vm=vm, local_port=parse_port(local, "local")).delete()

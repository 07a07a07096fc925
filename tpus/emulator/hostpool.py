"""Hosts the emulated lab makes new TPU VMs of. A test or the demo offers real hosts
(the sshd test fleet's: their addresses and host keys) with ``Controls.add_hosts``;
from then on a node that Google would make (CreateNode, a queued resource getting
capacity) takes free hosts for its workers, and the zone's capacity is also bounded
by how many are free. A node that is deleted or preempted gives its hosts back as
*released*: whatever runs the hosts (``testfleet.guestagent``) makes each a new machine
(empty /etc and homes, new host keys, a new boot) and offers it again with its new
keys, as Google hands a re-created VM fresh hardware. Without offered hosts, nodes get
made-up addresses and keys, as before.

``state["host_pool"]`` maps a host's address to
``{"name", "host_keys": {type: "type base64"}, "state": "free|used|released", "node"}``.
"""

from __future__ import annotations

from typing import Any

from tpus.emulator.store import State

FREE, USED, RELEASED = "free", "used", "released"


def pool(state: State) -> dict[str, dict[str, Any]]:
    return state.setdefault("host_pool", {})


def free(state: State) -> list[str]:
    return [ip for ip, host in sorted(pool(state).items()) if host["state"] == FREE]


def enough(state: State, count: int) -> bool:
    """Whether a node of ``count`` workers can be made now (always, without a pool)."""
    return not pool(state) or len(free(state)) >= count


def take(state: State, node: str, count: int) -> list[tuple[str, dict[str, str]]] | None:
    """``count`` free hosts for ``node``, as (address, host keys); None without a
    pool (the node gets made-up workers). Raises LookupError when too few are free."""
    if not pool(state):
        return None
    chosen = free(state)[:count]
    if len(chosen) < count:
        raise LookupError(f"{count} hosts needed, {len(chosen)} free")
    taken = []
    for ip in chosen:
        host = pool(state)[ip]
        host.update(state=USED, node=node)
        taken.append((ip, dict(host["host_keys"])))
    return taken


def release(state: State, node: str) -> None:
    """The node's hosts go back, to be made new before anyone gets them again."""
    for host in pool(state).values():
        if host.get("node") == node:
            host.update(state=RELEASED, node=None)


def drop_node(state: State, node: str) -> None:
    """Delete a node and give its hosts back."""
    state["nodes"].pop(node, None)
    release(state, node)

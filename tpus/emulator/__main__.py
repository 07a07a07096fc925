"""``python -m tpus.emulator``: serve the Cloud TPU API emulator and control it.

Every command works on one state file: ``--state FILE``, else ``$TPU_EMULATOR_STATE``,
else ``var/tpu-emulator.json``. Controls change the file; a running server sees the
change at its next call.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import defaultdict

from tpus.emulator.controls import ControlError, Controls
from tpus.emulator.server import LOOPBACK, EmulatorServer


def _serve(args: argparse.Namespace) -> None:
    try:
        server = EmulatorServer(
            args.state, host=args.host, port=args.port, operation_delay=args.operation_delay
        ).start()
    except RuntimeError as exc:
        raise ControlError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    # The first line says where it listens (tests and scripts read it, --port 0 included).
    print(f"TPU API emulator listening on {server.endpoint} (state: {args.state})", flush=True)
    # SIGTERM stops it as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()


def _host_keys(entries: list[list[str]]) -> dict[int, dict[str, str]]:
    keys: dict[int, dict[str, str]] = defaultdict(dict)
    for worker, key_type, value in entries:
        keys[int(worker)][key_type] = value
    return dict(keys)


def _add_node(c: Controls, a: argparse.Namespace) -> None:
    name = c.add_node(
        a.project,
        a.zone,
        a.name,
        accelerator_type=a.type,
        workers=a.workers,
        topology=a.topology,
        runtime_version=a.runtime_version,
        internal_ips=a.internal_ip,
        external_ips=a.external_ip,
        host_keys=_host_keys(a.host_key),
        labels=dict(label.split("=", 1) for label in a.label),
        metadata=_metadata_values(a.metadata, a.metadata_from_file),
        preemptible=a.preemptible,
        spot=a.spot,
    )
    print(name)


def _metadata_values(
    pairs: list[str], files: list[str], removed: list[str] = ()
) -> dict[str, str | None]:
    """``KEY=VALUE`` and ``KEY=PATH`` (the file's text, for multi-line ``ssh-keys``)
    arguments, as gcloud's ``--metadata`` and ``--metadata-from-file`` take them."""
    values: dict[str, str | None] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ControlError(f"{pair!r}: expected KEY=VALUE")
        values[key] = value
    for pair in files:
        key, sep, path = pair.partition("=")
        if not sep:
            raise ControlError(f"{pair!r}: expected KEY=PATH")
        try:
            with open(path) as handle:
                values[key] = handle.read()
        except OSError as exc:
            raise ControlError(f"{path}: {exc.strerror}") from None
    for key in removed:
        values[key] = None
    return values


def _set_metadata(c: Controls, a: argparse.Namespace) -> None:
    values = _metadata_values(a.pairs, a.metadata_from_file, a.remove)
    if a.after_next_get:
        c.change_metadata_after_next_get(a.node, values)
    else:
        c.set_metadata(a.node, values, replace=a.replace)


def _nodes(text: str) -> int | None:
    if text == "unlimited":
        return None
    if not text.isdigit():
        raise ControlError(f"{text!r}: a number of nodes, or 'unlimited'")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument(
        "--state",
        default=os.environ.get("TPU_EMULATOR_STATE", "var/tpu-emulator.json"),
        help="the state file (default: $TPU_EMULATOR_STATE or var/tpu-emulator.json)",
    )
    parser = argparse.ArgumentParser(prog="python -m tpus.emulator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[state])

    p = command("serve", "serve the API until interrupted")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--host", default=LOOPBACK, help="listen address (default 127.0.0.1)")
    p.add_argument(
        "--operation-delay", type=float, default=0.0, help="seconds before an operation is done"
    )

    p = command("add-node", "add a TPU VM")
    p.add_argument("project")
    p.add_argument("zone")
    p.add_argument("name")
    p.add_argument("--type", default="v4-8", help="accelerator type, e.g. v4-32")
    p.add_argument("--workers", type=int, help="default: from the type (v4-32 → 4)")
    p.add_argument("--topology")
    p.add_argument("--runtime-version", default="tpu-ubuntu2204-base")
    p.add_argument("--internal-ip", action="append", default=[], help="one per worker")
    p.add_argument("--external-ip", action="append", default=[], help="one per worker")
    p.add_argument(
        "--host-key",
        nargs=3,
        action="append",
        default=[],
        metavar=("WORKER", "TYPE", "PUBKEY"),
        help="publish PUBKEY (base64) under hostkeys/TYPE for WORKER; repeatable",
    )
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--metadata-from-file", action="append", default=[], metavar="KEY=PATH")
    p.add_argument("--preemptible", action="store_true")
    p.add_argument("--spot", action="store_true")

    p = command("set-ip", "give a worker a new external IP")
    p.add_argument("node")
    p.add_argument("worker", type=int)
    p.add_argument("ip")
    p.add_argument("--internal", action="store_true", help="change the internal IP instead")

    p = command("set-host-key", "publish a new host key for a worker")
    p.add_argument("node")
    p.add_argument("worker", type=int)
    p.add_argument("type")
    p.add_argument("pubkey")

    p = command("set-state", "set a node's state and/or health")
    p.add_argument("node")
    p.add_argument("--node-state", help="e.g. READY, STOPPED, REPAIRING")
    p.add_argument("--health")

    p = command("maintenance", "start a maintenance event (unhealthy, no external IPs)")
    p.add_argument("node")
    p = command("maintenance-end", "end it: READY, HEALTHY, new external IPs")
    p.add_argument("node")
    p.add_argument("--external-ip", action="append", default=[], help="one per worker")
    p = command("preempt", "preempt a node")
    p.add_argument("node")
    p = command("delete", "delete a node")
    p.add_argument("node")

    p = command("add-disk", "create a data disk")
    p.add_argument("project")
    p.add_argument("zone")
    p.add_argument("name")
    p.add_argument("--size-gb", type=int, default=100)
    p = command("attach", "attach a disk directly (to set a scene up)")
    p.add_argument("node")
    p.add_argument("disk", help="disk name in the node's zone, or its full path")
    p.add_argument("--mode", choices=["READ_ONLY", "READ_WRITE"], default="READ_ONLY")

    p = command("set-metadata", "set a node's metadata keys (as a change made elsewhere)")
    p.add_argument("node")
    p.add_argument("pairs", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--metadata-from-file", action="append", default=[], metavar="KEY=PATH")
    p.add_argument("--remove", action="append", default=[], metavar="KEY")
    p.add_argument("--replace", action="store_true", help="the given keys become the whole map")
    p.add_argument(
        "--after-next-get",
        action="store_true",
        help="apply the change right after the node's next GetNode (a concurrent change)",
    )
    p = command("metadata", "print a node's metadata as JSON")
    p.add_argument("node")
    p = command("deny-update", "UpdateNode of a node answers PERMISSION_DENIED")
    p.add_argument("node")
    p.add_argument("--allow", action="store_true", help="allow updates again")
    p = command("oslogin", "turn OS Login on or off for a project (project metadata)")
    p.add_argument("project")
    p.add_argument("switch", choices=["on", "off"])

    p = command("capacity", "how many nodes of a type a zone can hold (0: a stockout)")
    p.add_argument("zone")
    p.add_argument("type", help="accelerator type, e.g. v4-32")
    p.add_argument("nodes", help="a number of nodes, or 'unlimited' to release the limit")
    p = command("fail-request", "fail a queued resource as the service would")
    p.add_argument("request", help="its id (tpu5-request) or full name")
    p.add_argument("code", help="e.g. RESOURCE_EXHAUSTED (quota), INVALID_ARGUMENT")
    p.add_argument("message")
    command("queued", "print the queued resources as JSON")

    p = command("fail", "make the next N calls fail with a gRPC status code")
    p.add_argument("count", type=int)
    p.add_argument("code", help="e.g. UNAVAILABLE, RESOURCE_EXHAUSTED, PERMISSION_DENIED")
    p.add_argument("--method", help="only calls of this method, e.g. ListNodes")
    p = command("slow", "answer every call about a project this many seconds late")
    p.add_argument("project")
    p.add_argument("seconds", type=float, help="0 answers at once again")
    command("clear-faults", "drop pending injected failures and slow projects")
    command("show", "print the state as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        try:
            _serve(args)
        except ControlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    c = Controls(args.state)
    actions = {
        "add-node": lambda: _add_node(c, args),
        "set-ip": lambda: c.set_ip(args.node, args.worker, args.ip, internal=args.internal),
        "set-host-key": lambda: c.set_host_key(args.node, args.worker, args.type, args.pubkey),
        "set-state": lambda: c.set_state(args.node, state=args.node_state, health=args.health),
        "maintenance": lambda: c.maintenance(args.node),
        "maintenance-end": lambda: c.end_maintenance(args.node, args.external_ip),
        "preempt": lambda: c.preempt(args.node),
        "delete": lambda: c.delete(args.node),
        "add-disk": lambda: print(
            c.add_disk(args.project, args.zone, args.name, size_gb=args.size_gb)
        ),
        "attach": lambda: c.attach(args.node, args.disk, args.mode),
        "set-metadata": lambda: _set_metadata(c, args),
        "metadata": lambda: print(json.dumps(c.metadata(args.node), indent=2, sort_keys=True)),
        "deny-update": lambda: c.deny_update(args.node, not args.allow),
        "oslogin": lambda: c.set_oslogin(args.project, args.switch == "on"),
        "capacity": lambda: c.set_capacity(args.zone, args.type, _nodes(args.nodes)),
        "fail-request": lambda: c.fail_request(args.request, args.code, args.message),
        "queued": lambda: print(json.dumps(c.queued_resources(), indent=2, sort_keys=True)),
        "fail": lambda: c.fail(args.count, args.code, method=args.method),
        "slow": lambda: c.slow(args.project, args.seconds),
        "clear-faults": c.clear_faults,
        "show": lambda: print(json.dumps(c.show(), indent=2, sort_keys=True)),
    }
    try:
        actions[args.command]()
    except ControlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m testfleet``: start, disturb, inspect and remove a fleet of sshd hosts.

Examples::

    python -m testfleet up 32
    python -m testfleet status
    python -m testfleet move h3 10.213.9.9
    python -m testfleet reboot h3
    python -m testfleet down h3 [--unreachable]   /   start h3
    python -m testfleet exec h3 -- getent passwd milo
    python -m testfleet host-keys h3
    python -m testfleet ssh-keys h3 tpu-portal "ssh-ed25519 AAAA… tpu-portal@demo"
    python -m testfleet stop          # every host stopped; the next `up` boots the same ones
    python -m testfleet teardown
    python -m testfleet agent --emulator-state var/tpu-emulator.json   # guest agent
    python -m testfleet offer --emulator-state var/tpu-emulator.json h5 h6 h7 h8
    python -m testfleet renew h5      # a new machine: empty /etc and homes, new host keys
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from testfleet.fleet import Fleet
from testfleet.slots import SlotBusy
from testfleet.system import FleetError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m testfleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--slot", type=int, default=0, help="fleet slot (default 0)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start hosts h1..hN (idempotent)")
    up.add_argument("count", type=int)
    sub.add_parser("status", help="hosts, addresses, states, boot ids (JSON)")
    move = sub.add_parser("move", help="give a host another address")
    move.add_argument("host")
    move.add_argument("ip", nargs="?", help="default: a free address of the subnet")
    for name, text in (
        ("reboot", "kill all of a host's processes and boot it again"),
        ("start", "bring a host back onto the network"),
        ("host-keys", "a host's public host keys, one per line"),
    ):
        sub.add_parser(name, help=text).add_argument("host")
    down = sub.add_parser("down", help="take a host off the network (connects hang)")
    down.add_argument("host")
    down.add_argument(
        "--unreachable",
        action="store_true",
        help="connects fail with 'No route to host' instead of hanging",
    )
    rekey = sub.add_parser("rekey", help="new host keys, then reboot")
    rekey.add_argument("host")
    run = sub.add_parser("exec", help="run a command as root inside a host")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    keys = sub.add_parser(
        "ssh-keys", help="an account with sudo and exactly these keys, as Google's guest agent"
    )
    keys.add_argument("host")
    keys.add_argument("user")
    keys.add_argument("keys", nargs="*", help="public key lines (none: the account loses its keys)")
    sub.add_parser("admin-key", help="path of the admin private key the hosts trust")
    sub.add_parser(
        "stop", help="stop every host but keep addresses, keys and homes for the next up"
    )
    renew = sub.add_parser(
        "renew", help="a new machine at the same address: empty /etc and homes, new host keys"
    )
    renew.add_argument("host")
    offer = sub.add_parser(
        "offer", help="offer hosts to the emulator as the machines new TPU VMs are made of"
    )
    offer.add_argument("--emulator-state", required=True, help="the emulator's state file")
    offer.add_argument("hosts", nargs="+")
    sub.add_parser("teardown", help="remove every process, namespace, link and file")
    agent = sub.add_parser(
        "agent", help="apply emulated nodes' ssh-keys metadata to their hosts, as the guest agent"
    )
    agent.add_argument("--emulator-state", required=True, help="the emulator's state file")
    agent.add_argument("--interval", type=float, default=1.0, help="seconds between passes")
    agent.add_argument("--once", action="store_true", help="one pass, then exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "agent":
        from testfleet.guestagent import run_forever

        try:
            run_forever(args.slot, args.emulator_state, interval=args.interval, once=args.once)
        except KeyboardInterrupt:
            pass
        return 0
    try:
        fleet = Fleet.open(args.slot)
    except SlotBusy as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return _dispatch(fleet, args)
    except BrokenPipeError:  # `… | head`
        return 0
    except FleetError as exc:
        print(f"testfleet: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.close()


def _dispatch(fleet: Fleet, args) -> int:
    command = args.command
    if command == "up":
        started = time.monotonic()
        hosts = fleet.up(args.count)
        print(
            f"{len(hosts)} hosts up in {time.monotonic() - started:.2f} s "
            f"on {fleet.bridge} ({fleet.network}); admin key {fleet.admin_key_path}"
        )
        for h in hosts:
            print(f"{h.name}\t{h.ip}")
    elif command == "status":
        print(json.dumps(fleet.status(), indent=1))
    elif command == "move":
        print(fleet.move(args.host, args.ip))
    elif command == "reboot":
        print(fleet.reboot(args.host))
    elif command == "down":
        fleet.down(args.host, hang=not args.unreachable)
    elif command == "start":
        fleet.start(args.host)
    elif command == "rekey":
        print("\n".join(fleet.rekey(args.host)))
    elif command == "renew":
        print("\n".join(fleet.renew(args.host)))
    elif command == "offer":
        from testfleet.guestagent import offer_hosts
        from tpus.emulator.store import Store

        offer_hosts(fleet, Store(args.emulator_state), args.hosts)
    elif command == "host-keys":
        print("\n".join(fleet.host_keys(args.host)))
    elif command == "exec":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            print("exec needs a command after --", file=sys.stderr)
            return 2
        proc = fleet.exec(args.host, argv, check=False, timeout=3600)
        sys.stdout.buffer.write(proc.stdout)
        sys.stderr.buffer.write(proc.stderr)
        return proc.returncode
    elif command == "ssh-keys":
        fleet.set_ssh_keys(args.host, {args.user: args.keys} if args.keys else {})
    elif command == "admin-key":
        print(fleet.admin_key_path)
    elif command == "stop":
        fleet.stop()
    elif command == "teardown":
        started = time.monotonic()
        fleet.destroy()
        print(f"torn down in {time.monotonic() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

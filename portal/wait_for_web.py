"""Wait until a web server answers HTTP, for scripts that start one and then tell a
person where to go (``bin/demo``): the address is printed once it works, not while
the server is still starting.

    python -m portal.wait_for_web http://127.0.0.1:8000/healthz --pid 1234 --timeout 300

Any HTTP answer counts (a 503 from /healthz while beat has not sent its first
heartbeat is still a server that answers). Exits 0 once one came; 1 when the process
``--pid`` (the server's, or the script that runs it) ended first, or after
``--timeout`` seconds, saying which."""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):  # noqa: S310 (an http URL of ours)
            return True
    except urllib.error.HTTPError:
        return True  # an answer, whatever its status
    except OSError:
        return False


def alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait(url: str, *, pid: int | None, timeout: float, every: float = 0.25) -> str | None:
    """None once ``url`` answers; else why not."""
    deadline = time.monotonic() + timeout
    while True:
        if answers(url):
            return None
        if not alive(pid):
            return f"the process {pid} ended before {url} answered"
        if time.monotonic() > deadline:
            return f"{url} did not answer within {timeout:.0f} s"
        time.sleep(every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--pid", type=int, help="give up when this process has ended")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    problem = wait(args.url, pid=args.pid, timeout=args.timeout)
    if problem:
        print(f"wait_for_web: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

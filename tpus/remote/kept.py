"""SSH connections kept open between runs, one per worker, as ssh's ControlMaster does.

A pass of the job engine, a reconcile or a look at a job's log each logged in to every
worker anew: 32 handshakes and logins before a pod's job could start. Now a connection
whose runs are over is given back here and lent again to the next run for the same
worker in this process, so the next pass (a poll, a cancel, the next job's pre-flight
and start, a reconcile) costs one channel per worker, not one login.

What keeps this safe:

- A connection is lent to one run at a time (a run that finds none idle makes its own),
  so nothing ever waits for another run's connection, and closing one (a run given up
  on) touches no other run.
- It is kept under everything that decided whom it reached: the address, the port,
  the login (account and key) and the pinned host keys, and the worker's generation,
  which the portal raises whenever it forgets how it reached a worker (Disconnect, a
  host key changed or forgotten). A different key is a different connection; a kept
  one under an old key to the same address is closed at the next lending.
- It closes after ``PORTAL_REMOTE_KEEP_SECONDS`` unused (0: nothing is kept), by a
  thread that lives only while something is kept.
- While idle it sends a keepalive every few seconds and the kernel gives up on it once
  those go unanswered for the connect timeout (``TCP_USER_TIMEOUT``), so a connection
  to a host that went away is found dead by the next lending's ``is_active()``. What
  that cannot see (a host whose kernel still answers but whose sshd hangs) is bounded
  by the run: on a lent connection the channel must open within the connect timeout.
- After a fork (Celery's prefork pool), the child keeps none of its parent's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

import paramiko

# While idle: a keepalive after this many seconds without traffic, so a dead peer is
# noticed (TCP_USER_TIMEOUT counts from the first unanswered packet).
IDLE_KEEPALIVE_SECONDS = 5


@dataclass(frozen=True)
class Key:
    """Everything that decided whom a connection reached, as it was made."""

    address: str
    port: int
    user: str
    login_key: str
    pins: tuple[str, ...]
    generation: int


@dataclass
class _Idle:
    client: paramiko.SSHClient
    until: float


@dataclass
class Counts:
    """How this process's connections were had (for tests and benchmarks)."""

    made: int = 0
    lent: int = 0
    closed_idle: int = 0
    shells: int = 0  # root shells started on connections (tpus.remote.ssh)
    shell_runs: int = 0  # runs those shells answered, or began to


class KeptConnections:
    """This process's idle connections, by Key. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle: dict[Key, _Idle] = {}
        self._reaper: threading.Thread | None = None
        self.counts = Counts()

    def take(self, key: Key) -> paramiko.SSHClient | None:
        """An idle live connection made under ``key``, now lent to the caller, or None.
        Idle ones to the same address and port under another key are closed."""
        now = time.monotonic()
        closing = []
        with self._lock:
            for other in [k for k in self._idle if _same_place(k, key) and k != key]:
                closing.append(self._idle.pop(other).client)
            entry = self._idle.pop(key, None)
            lent = None
            if entry is not None:
                if entry.until > now and _alive(entry.client):
                    lent = entry.client
                    self.counts.lent += 1
                else:
                    closing.append(entry.client)
        for client in closing:
            _close(client)
        if lent is not None:
            _busy(lent)
        return lent

    def made(self) -> None:
        with self._lock:
            self.counts.made += 1

    def counted(self, *, shells: int = 0, shell_runs: int = 0) -> None:
        with self._lock:
            self.counts.shells += shells
            self.counts.shell_runs += shell_runs

    def give_back(
        self, key: Key, client: paramiko.SSHClient, *, keep_seconds: float, dead_after: float
    ) -> None:
        """Keep ``client`` for ``keep_seconds`` (closed at once when it is not alive, or
        nothing is kept). An idle one already kept under ``key`` is closed instead."""
        if keep_seconds <= 0 or not _alive(client):
            _close(client)
            return
        _idle(client, dead_after)
        with self._lock:
            older = self._idle.pop(key, None)
            self._idle[key] = _Idle(client, time.monotonic() + keep_seconds)
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="ssh-kept-reaper", daemon=True
                )
                self._reaper.start()
            self._wake.notify()
        if older is not None:
            _close(older.client)

    def forget(self, address: str) -> int:
        """Close every idle connection to ``address``; how many there were."""
        with self._lock:
            gone = [self._idle.pop(k).client for k in list(self._idle) if k.address == address]
        for client in gone:
            _close(client)
        return len(gone)

    def clear(self) -> None:
        """Close every idle connection."""
        with self._lock:
            gone = [entry.client for entry in self._idle.values()]
            self._idle.clear()
            self._wake.notify()
        for client in gone:
            _close(client)

    def idle(self) -> list[Key]:
        with self._lock:
            return list(self._idle)

    def _reap(self) -> None:
        """Close connections whose time is up; end once nothing is kept."""
        while True:
            with self._lock:
                if not self._idle:
                    self._reaper = None
                    return
                now = time.monotonic()
                expired = [k for k, e in self._idle.items() if e.until <= now]
                gone = [self._idle.pop(k).client for k in expired]
                self.counts.closed_idle += len(gone)
                if not gone:
                    soonest = min(e.until for e in self._idle.values())
                    self._wake.wait(max(0.05, soonest - now))
            for client in gone:
                _close(client)

    def _after_fork(self) -> None:
        """In a forked child: the parent's connections are not ours (their threads did
        not come along); let go of our copies of their sockets without a word to the
        hosts, and start empty."""
        for entry in self._idle.values():
            transport = entry.client.get_transport()
            sock = getattr(transport, "sock", None)
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.close()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = {}
        self._reaper = None
        self.counts = Counts()


def _same_place(a: Key, b: Key) -> bool:
    return a.address == b.address and a.port == b.port


def _alive(client: paramiko.SSHClient) -> bool:
    transport = client.get_transport()
    return transport is not None and transport.is_active()


def _socket(client: paramiko.SSHClient):
    transport = client.get_transport()
    sock = getattr(transport, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _idle(client: paramiko.SSHClient, dead_after: float) -> None:
    """Idle: keepalives, and the kernel gives up on unanswered ones after
    ``dead_after`` seconds (which ends the transport)."""
    client.get_transport().set_keepalive(IDLE_KEEPALIVE_SECONDS)
    sock = _socket(client)
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(dead_after * 1000))


def _busy(client: paramiko.SSHClient) -> None:
    """Lent to a run: as a fresh connection is (a run's own timeouts apply)."""
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(0)
    sock = _socket(client)
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)


def _close(client: paramiko.SSHClient) -> None:
    with contextlib.suppress(Exception):  # what may be broken already
        client.close()


kept = KeptConnections()
os.register_at_fork(after_in_child=kept._after_fork)


def forget(address: str) -> int:
    """Close this process's idle connections to ``address``."""
    return kept.forget(address)

"""Run one shipped script on one worker over one SSH connection: the door's choke point.

How a script travels. The command line is the same constant for every run::

    sudo -n -- /bin/sh -c 'set -eu; n=$(head -c 10); s=$(head -c "$n");
                           exec /bin/sh -c "$s" "$0"' whoami.sh

and stdin carries, in order, the script's length as ten digits, the script, and the
script's data. So no byte of data is ever part of a command line, the script needs no
temporary file on the host (no upload, no path a collaborator could race), and the run
costs one channel: one round trip after authentication. ``head -c`` reads exactly the
bytes it is asked for, so the data the script reads from stdin starts right after it.

A script answers with ``key=value`` lines on stdout (other lines are ignored), exits
non-zero with its reason as the last line of stderr, and is idempotent.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import select
import shlex
import socket
import time
from dataclasses import dataclass, field

import paramiko
from django.conf import settings

from tpus.remote import config as remote_config
from tpus.remote.errors import HostKeyMismatch, RemoteError
from tpus.remote.pins import HostKeyPins
from tpus.remote.scripts import Script

log = logging.getLogger(__name__)

_BOOTSTRAP = 'set -eu; n=$(head -c 10); s=$(head -c "$n"); exec /bin/sh -c "$s" "$0"'
_RESULT_LINE = re.compile(r"^([a-z][a-z0-9_.-]*)=(.*)$")
MAX_OUTPUT_BYTES = 4 * 1024 * 1024
# Never offered: CBC and 3DES ciphers, SHA-1 and MD5 MACs, SHA-1 key exchanges.
_DISABLED_ALGORITHMS = {
    "ciphers": ["3des-cbc", "aes128-cbc", "aes192-cbc", "aes256-cbc"],
    "macs": ["hmac-sha1", "hmac-md5", "hmac-sha1-96", "hmac-md5-96"],
    "kex": ["diffie-hellman-group14-sha1", "diffie-hellman-group-exchange-sha1",
            "diffie-hellman-group1-sha1"],
}  # fmt: skip
# Key exchanges in order of preference. Post-quantum hybrid first where the host has
# it (OpenSSH 9.9+). Then ECDH on P-256 ahead of X25519: sshd computes P-256 with
# OpenSSL's optimised code but X25519 with its own portable reference code, which cost
# about 11 ms of the worker's CPU per connection on the fleet (1.46 against 1.10 CPU-s
# for 32 logins), time every login waits for. X25519 stays allowed for hosts that
# offer nothing else. Both are standard and unbroken; neither resists a quantum
# computer, which only the hybrid does.
_KEX_ORDER = ("mlkem768x25519-sha256", "ecdh-sha2-nistp256", "curve25519-sha256@libssh.org")


@dataclass(frozen=True)
class Worker:
    """One TPU VM worker as the door needs it: where it is now and who it must be."""

    address: str
    pins: HostKeyPins
    port: int = 22
    name: str = ""
    # The lab's account and key; a worker without one is never contacted.
    login: remote_config.Login | None = None

    def __str__(self) -> str:
        return self.name or self.address


@dataclass
class ScriptResult:
    """What a script answered: its ``key=value`` lines, raw output, and timing."""

    worker: Worker
    script: str
    exit_status: int
    stdout: str = ""
    stderr: str = ""
    pairs: list[tuple[str, str]] = field(default_factory=list)
    elapsed: float = 0.0
    dry_run: bool = False

    @property
    def values(self) -> dict[str, str]:
        """The answer as a dict (for a key given more than once, the last value)."""
        return dict(self.pairs)

    def all(self, key: str) -> list[str]:
        """Every value given for ``key``, in order (for list-like answers)."""
        return [value for name, value in self.pairs if name == key]


def command_for(script: Script) -> str:
    """The fixed command line that runs ``script`` with the data that follows it."""
    return f"sudo -n -- /bin/sh -c {shlex.quote(_BOOTSTRAP)} {shlex.quote(script.name)}"


def execute(
    worker: Worker, script: Script, data: bytes = b"", *, dry_run: bool | None = None
) -> ScriptResult:
    """Connect to ``worker``, run ``script`` with ``data`` on stdin, return its answer.

    Raises RemoteError (HostKeyMismatch for a host key other than the pinned one)."""
    with Connection(worker) as connection:
        return connection.run(script, data, dry_run=dry_run)


class Connection:
    """One SSH connection to a worker that runs scripts one after another (each in its
    own channel), for work with steps on every worker of a VM (a job's pre-flight, then
    its start) that should log in once. Connects on the first run; every check of
    ``execute`` applies."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.client: paramiko.SSHClient | None = None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def run(
        self, script: Script, data: bytes = b"", *, dry_run: bool | None = None
    ) -> ScriptResult:
        worker = self.worker
        check_allowed(worker)
        cfg = remote_config.current()
        if dry_run if dry_run is not None else cfg.dry_run:
            log.info("dry run: would run %s on %s with %d bytes", script.name, worker, len(data))
            return ScriptResult(worker, script.name, 0, dry_run=True)
        if not worker.pins:
            raise RemoteError(
                "no host key is pinned for this worker; refusing to connect",
                kind=RemoteError.NO_PIN,
                retryable=False,
                worker=str(worker),
            )
        if worker.login is None:
            raise RemoteError(
                "no login is known for this worker's lab; refusing to connect",
                kind=RemoteError.AUTH,
                retryable=False,
                worker=str(worker),
            )
        started = time.monotonic()
        if self.client is None:
            self.client = _connect(worker, cfg)
        try:
            payload = f"{len(script.body):010d}".encode() + script.body + data
            status, out, err = _run(
                self.client, command_for(script), payload, cfg.script_timeout, worker
            )
        except RemoteError:
            self.close()  # a broken connection is not used again
            raise
        elapsed = time.monotonic() - started
        stdout = out.decode(errors="replace")
        stderr = err.decode(errors="replace")
        log.info("%s on %s: exit %s in %.2f s", script.name, worker, status, elapsed)
        if status != 0:
            reason = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
            raise RemoteError(
                f"{script.name} failed (exit {status}): {reason[:500] or 'no message'}",
                kind=RemoteError.SCRIPT,
                retryable=False,
                worker=str(worker),
                exit_status=status,
                stderr=stderr[-4000:],
            )
        pairs = [(m[1], m[2]) for ln in stdout.splitlines() if (m := _RESULT_LINE.match(ln))]
        return ScriptResult(worker, script.name, status, stdout, stderr, pairs, elapsed)


def check_allowed(worker: Worker) -> None:
    """With ``PORTAL_REMOTE_ALLOWED_NETWORKS`` set, refuse any other address before a
    packet is sent (a deployment's egress rule; the test suite's safety net)."""
    networks = settings.PORTAL_REMOTE_ALLOWED_NETWORKS
    if not networks:
        return
    try:
        address = ipaddress.ip_address(worker.address)
    except ValueError:
        address = None
    if address is None or not any(address in ipaddress.ip_network(n) for n in networks):
        raise RemoteError(
            f"{worker.address or 'no address'} is outside PORTAL_REMOTE_ALLOWED_NETWORKS",
            kind=RemoteError.NOT_ALLOWED,
            retryable=False,
            worker=str(worker),
        )


class _PromptSocket(socket.socket):
    """A TCP socket that never holds back an ACK or a small packet.

    sshd sets TCP_NODELAY only for interactive sessions, so on an exec session it keeps
    a small packet back (Nagle) until the one before it is acknowledged, and Linux
    delays an ACK by up to 40 ms. Right after authentication sshd sends a small
    "hostkeys" message and then the channel confirmation: without these options that
    one exchange cost 40 ms, and each connection about 90 ms of waiting in all (three
    times the CPU work of a login on the fleet). TCP_NODELAY keeps our own small packets
    from waiting; TCP_QUICKACK is reset by the kernel, so it is set again after every
    read, which also sends the ACK still pending for what was just read.
    """

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if data:
            try:
                self.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                pass  # the connection is going away; the next read says so
        return data


def open_socket(address: str, port: int, timeout: float) -> socket.socket:
    """A connected TCP socket to ``address:port`` for paramiko (raises OSError)."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = _PromptSocket(family, kind, proto)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        sock.connect(where)
    except BaseException:
        sock.close()
        raise
    return sock


def _transport(sock, **kwargs) -> paramiko.Transport:
    """paramiko's Transport with the key exchanges in the door's order of preference."""
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    known = list(options.kex)
    first = [name for name in _KEX_ORDER if name in known]
    options.kex = first + [name for name in known if name not in first]
    return transport


def _connect(worker: Worker, cfg: remote_config.RemoteConfig) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    # paramiko looks the server up under "ip" for port 22 and "[ip]:port" otherwise.
    lookup = worker.address if worker.port == 22 else f"[{worker.address}]:{worker.port}"
    known = client.get_host_keys()
    for key in worker.pins.paramiko_keys():
        known.add(lookup, key.get_name(), key)
    where = str(worker)
    login = worker.login
    try:
        sock = open_socket(worker.address, worker.port, cfg.connect_timeout)
        client.connect(
            worker.address,
            port=worker.port,
            sock=sock,
            username=login.user,
            pkey=login.key,
            timeout=cfg.connect_timeout,
            banner_timeout=cfg.auth_timeout,
            auth_timeout=cfg.auth_timeout,
            channel_timeout=cfg.auth_timeout,
            allow_agent=False,
            look_for_keys=False,
            compress=False,
            disabled_algorithms=_DISABLED_ALGORITHMS,
            transport_factory=_transport,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        presented = f"{exc.key.get_name()} {exc.key.get_base64()}"
        raise HostKeyMismatch(
            f"the host key changed: it presented {exc.key.get_name()} "
            f"{exc.key.fingerprint}, which is not pinned",
            worker=where,
            presented=presented,
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        if "timeout" in str(exc).lower():
            # paramiko reports a server too busy to answer within auth_timeout as an
            # authentication failure; it is a timeout, and trying again can help.
            raise RemoteError(
                f"timed out logging in: {exc}",
                kind=RemoteError.TIMEOUT,
                retryable=True,
                worker=where,
            ) from None
        raise RemoteError(
            f"the worker does not accept the lab's key for {login.user!r} ({exc}); "
            "connect the VM to the lab (its ssh-keys metadata) first",
            kind=RemoteError.AUTH,
            retryable=False,
            worker=where,
        ) from None
    except TimeoutError as exc:
        client.close()
        raise RemoteError(
            f"timed out connecting: {exc or 'no answer'}",
            kind=RemoteError.TIMEOUT,
            retryable=True,
            worker=where,
        ) from None
    except paramiko.SSHException as exc:
        client.close()
        text = str(exc)
        if "host key" in text:  # the server offered none of the pinned key types
            raise HostKeyMismatch(
                f"the worker offered none of the pinned host key types: {text}", worker=where
            ) from None
        timeout = "timeout" in text.lower() or "banner" in text.lower()
        raise RemoteError(
            f"SSH handshake failed: {text}",
            kind=RemoteError.TIMEOUT if timeout else RemoteError.PROTOCOL,
            retryable=True,
            worker=where,
        ) from None
    except OSError as exc:
        client.close()
        raise RemoteError(
            f"cannot connect: {exc.strerror or exc}",
            kind=RemoteError.UNREACHABLE,
            retryable=True,
            worker=where,
        ) from None
    return client


def _run(
    client: paramiko.SSHClient, command: str, payload: bytes, timeout: float, worker: Worker
) -> tuple[int, bytes, bytes]:
    """One channel: exec ``command``, send ``payload`` then EOF, collect both streams
    (interleaved, so a chatty stderr cannot stall the window), wait for the status."""
    where = str(worker)
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    try:
        transport = client.get_transport()
        channel = transport.open_session(timeout=max(1.0, deadline - time.monotonic()))
        channel.settimeout(max(0.1, deadline - time.monotonic()))
        channel.exec_command(command)
        try:
            channel.sendall(payload)
            channel.shutdown_write()
        except OSError:
            pass  # the script exited without reading all of it; its status tells why
        while True:
            if channel.recv_ready():
                _keep(out, channel.recv(65536))
                continue
            if channel.recv_stderr_ready():
                _keep(err, channel.recv_stderr(65536))
                continue
            # The exit status can overtake the last of the output (it waits for window
            # space we free by reading): stop only once the host also sent EOF.
            if channel.closed or (channel.exit_status_ready() and channel.eof_received):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if channel.eof_received:
                channel.status_event.wait(min(remaining, 1.0))
            else:
                select.select([channel], [], [], min(remaining, 1.0))
        # Output that arrived together with the exit status.
        while channel.recv_ready():
            _keep(out, channel.recv(65536))
        while channel.recv_stderr_ready():
            _keep(err, channel.recv_stderr(65536))
        status = channel.exit_status if channel.exit_status_ready() else -1
    except TimeoutError:
        raise RemoteError(
            f"the script did not finish within {timeout:.0f} s",
            kind=RemoteError.TIMEOUT,
            retryable=True,
            worker=where,
        ) from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise RemoteError(
            f"the connection broke while the script ran: {exc}",
            kind=RemoteError.DISCONNECTED,
            retryable=True,
            worker=where,
        ) from None
    if status == -1:
        raise RemoteError(
            "the script ended without an exit status (killed, or the host went away)",
            kind=RemoteError.DISCONNECTED,
            retryable=True,
            worker=where,
            stderr=err.decode(errors="replace")[-4000:],
        )
    return status, bytes(out), bytes(err)


def _keep(buffer: bytearray, chunk: bytes) -> None:
    """Append up to MAX_OUTPUT_BYTES; the rest is read and dropped."""
    room = MAX_OUTPUT_BYTES - len(buffer)
    if room > 0:
        buffer += chunk[:room]

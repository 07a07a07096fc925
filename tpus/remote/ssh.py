"""Run one shipped script on one worker over one SSH connection: the door's choke point.

How a script travels. The command line is the same constant for every run::

    sudo -n -- /bin/sh -c 'set -eu; read -r tpu_n; tpu_s=$(head -c "$tpu_n");
                           eval "$tpu_s"' whoami.sh

and stdin carries, in order, the script's length as ten digits and a newline, the
script, and the script's data. So no byte of data is ever part of a command line, the
script needs no temporary file on the host (no upload, no path a collaborator could
race), and the run costs one channel: one round trip after authentication. The shell's
``read`` takes the length line a byte at a time and ``head -c`` exactly the bytes it is
asked for, so the data the script reads from stdin starts right after it. The script
runs in the shell that read it (``eval``, as ``$0`` the script's name, no arguments):
one program fewer than a shell of its own, on every run of every worker.

A script answers with ``key=value`` lines on stdout (other lines are ignored), exits
non-zero with its reason as the last line of stderr, and is idempotent.

Two scripts in one exec (``Connection.begin``), for work that must be judged on every
worker before any worker goes on (a job's pre-flight, then its start)::

    sudo -n -- /bin/sh -c '<_TWO_STEPS>' job-preflight.sh job-start.sh

stdin carries one line with the three lengths (the first script, the second, the first
script's data; ten digits each), then both scripts and that data. The first script
runs (in a subshell, no arguments) with exactly that data as its stdin; once it has
exited 0, the host prints
``tpu-portal-step=done`` and waits for one line: ``go`` runs the second script with the
rest of stdin as its data; anything else, or the end of stdin (the portal went away),
ends the run with nothing more done.

Or the second script runs at once after the first, with its own data sent up front
(``Connection.begin`` with ``then_data``: a job's start prepares everything it can
while the other workers still check, and reads the word itself)::

    sudo -n -- /bin/sh -c '<_PREPARED>' job-preflight.sh job-start.sh

stdin is the same, then the second script's data; the word (``go`` and what the
second script wants with it) comes after that, and the second script reads it.

The kept shell. Each exec above costs the worker sshd's session, the account's login
shell, sudo (PAM, sudoers) and a shell: about 11-13 ms of its CPU per run, most of a
job start's. So a kept connection (``kept``) keeps one root shell open on one channel,
started by the connection's first run the same way::

    sudo -n -- /bin/sh -c '<_SHELL>' tpu-portal-shell

and each later run of the connection sends it one request on that channel's stdin
instead of opening an exec: a line (a kind, a random 128-bit nonce, the lengths, each
script's SHA-256), the scripts the shell does not have yet (it keeps each by digest,
so a script travels and is read once per shell), then the data. The shell runs each
script in a subshell (``set -eu``, no arguments) with exactly its data as stdin,
through a pipe (what the script leaves unread is read away): short text the shell
relays a line at a time itself, anything else ``head -c`` (a program), so one
run's variables, functions, traps, directory, umask, descriptors and ``exit`` never
reach the next. On both streams it prints ``tpu-portal-run-<nonce>`` before the script
and ``tpu-portal-end-<nonce>`` (on stdout with the status) after it; the portal reads
each stream up to its markers. No script sees the nonce (the subshell unsets it), so
no output can end a run early or give it another status; script and data bytes are
never part of a command line. Two steps go the same way (kind ``t`` or ``p``, a
``tpu-portal-step-<nonce>`` marker between them, then ``go <length>`` and the word).

Only where that is safe: data of a known length (bytes; a stream of chunks, whose end
is the end of stdin, takes an exec of its own beside the shell), one run at a time
(a shell held by a Step sends another run to an exec). A shell whose run broke, timed
out or was interrupted goes with its connection (``drop``); one that ended between
runs is replaced on the same connection; one left between two steps without the word
is closed (the end of its stdin, as for an exec). It ends when its connection closes,
and a changed address, host key or generation never meets it (``kept.Key``). On a
shell that answered before, the run's first marker must come within the connect
timeout, as a new channel on a kept connection must open within it.
``PORTAL_REMOTE_KEEP_SHELL`` off: every run in an exec of its own.

It is a root shell reading only what the portal sends on its authenticated channel,
as trusted as the sudo of each exec was. What a worker's admin sees differs: sudo logs
the shell's start once per connection, not one line per script. (An account taken out
of sudo's group keeps its root shell until the connection closes, as a kept login
keeps its groups, and sudo with them, until then.) Two smaller
differences: ``$0`` is ``tpu-portal-shell`` and ``$$`` the shell's pid, not the
script's; a script killed by a signal answers 128 + the signal's number (a SCRIPT
error) where an exec answered no status (DISCONNECTED).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import logging
import re
import secrets
import select
import shlex
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import paramiko
from django.conf import settings

from tpus.remote import config as remote_config
from tpus.remote import kept
from tpus.remote.errors import HostKeyMismatch, RemoteError
from tpus.remote.pins import HostKeyPins
from tpus.remote.scripts import Script

log = logging.getLogger(__name__)

# Every program started costs the host about a millisecond of CPU (on a VM, the
# loader's CPUID probes trap to the hypervisor), times every worker of a pod: the
# lengths are a line the shell reads itself (no program).
# The scripts run in the shell that read them (eval): no shell of their own to start.
# Its own names begin tpu_, which no script uses; neither sees an argument.
_BOOTSTRAP = 'set -eu; read -r tpu_n; tpu_s=$(head -c "$tpu_n"); eval "$tpu_s"'
_TWO_STEPS = (
    'set -eu; read -r tpu_n tpu_m tpu_k; tpu_a=$(head -c "$tpu_n"); '
    'tpu_b=$(head -c "$tpu_m"); set --; head -c "$tpu_k" | eval "$tpu_a"; '
    'echo tpu-portal-step=done; read -r tpu_word || tpu_word=""; '
    '[ "$tpu_word" = go ] || exit 0; eval "$tpu_b"'
)
_PREPARED = (
    'set -eu; read -r tpu_n tpu_m tpu_k; tpu_a=$(head -c "$tpu_n"); '
    'tpu_b=$(head -c "$tpu_m"); set --; head -c "$tpu_k" | eval "$tpu_a"; '
    'echo tpu-portal-step=done; eval "$tpu_b"'
)
_STEP_DONE = b"tpu-portal-step=done\n"
# The kept shell (module docstring). Each request is one line,
#   <kind> <nonce> <data length> <script digest> <script length> [<digest> <length> <length>]
# kind r: one script; t: two steps, the second after the word; p: two steps, the second
# at once (prepared), with its own data. A script's length is 0 when the shell has it
# already (it keeps each script it was sent, by digest: no program reads it again).
# Every script runs in a subshell (set -eu, no arguments) with exactly its data as
# stdin, through a pipe (what it leaves unread is read away). A data length l<count> is
# that many lines, which the shell relays itself (no program: short text, ``_size``);
# any other is bytes, relayed by head -c. The shell prints its markers with the
# request's nonce on both streams: run before the script, step between two steps, end
# with the status after. Anything malformed ends the shell.
_SHELL = r"""
tpu_num() { case $1 in "" | *[!0-9]*) exit 2 ;; esac; }
tpu_size() { case $1 in l0?*) exit 2 ;; l*) tpu_num "${1#l}" ;; *) tpu_num "$1" ;; esac; }
tpu_script() {
    case $1 in "" | *[!0-9a-f]*) exit 2 ;; esac
    tpu_num "$2"
    if [ "$2" -gt 0 ]; then
        tpu_s=$(head -c "$2")
        eval "tpu_c_$1=\$tpu_s"
    else
        eval "tpu_s=\${tpu_c_$1?}"
    fi
}
tpu_relay() {
    case $1 in
        0 | l0) ;;
        l*)
            tpu_i=${1#l}
            while [ "$tpu_i" -gt 0 ]; do
                IFS= read -r tpu_x || exit 2
                printf '%s\n' "$tpu_x"
                tpu_i=$((tpu_i - 1))
            done
            ;;
        *) head -c "$1" ;;
    esac
}
tpu_one() {
    (
        unset tpu_id
        set -eu --
        eval "$tpu_s"
    )
    tpu_rc=$?
    if IFS= read -r tpu_x || [ -n "$tpu_x" ]; then cat >/dev/null; fi
    return "$tpu_rc"
}
tpu_feed() {
    case $1 in 0 | l0) tpu_one </dev/null ;; *) tpu_relay "$1" | tpu_one ;; esac
}
tpu_mark() {
    printf 'tpu-portal-%s-%s%s\n' "$1" "$tpu_id" "$2"
    printf 'tpu-portal-%s-%s\n' "$1" "$tpu_id" >&2
}
while read -r tpu_kind tpu_id tpu_k tpu_ha tpu_na tpu_hb tpu_nb tpu_j; do
    case $tpu_id in "" | *[!0-9a-f]*) exit 2 ;; esac
    tpu_size "$tpu_k"
    tpu_script "$tpu_ha" "$tpu_na"
    tpu_a=$tpu_s
    case $tpu_kind in
        r) ;;
        t | p)
            tpu_script "$tpu_hb" "$tpu_nb"
            tpu_b=$tpu_s
            tpu_size "$tpu_j"
            ;;
        *) exit 2 ;;
    esac
    tpu_mark run ""
    tpu_s=$tpu_a
    tpu_feed "$tpu_k"
    tpu_rc=$?
    if [ "$tpu_kind" != r ] && [ "$tpu_rc" = 0 ]; then
        tpu_mark step ""
        tpu_s=$tpu_b
        if [ "$tpu_kind" = t ]; then
            read -r tpu_w tpu_l || exit 0
            [ "$tpu_w" = go ] || exit 0
            tpu_size "$tpu_l"
            tpu_feed "$tpu_l"
        else
            {
                tpu_relay "$tpu_j"
                read -r tpu_w tpu_l && [ "$tpu_w" = go ] && tpu_size "$tpu_l" &&
                    tpu_relay "$tpu_l"
            } | tpu_one
        fi
        tpu_rc=$?
    elif [ "$tpu_kind" = p ]; then
        tpu_relay "$tpu_j" >/dev/null
    fi
    tpu_mark end " $tpu_rc"
done
"""
# Data up to this size that is lines is read by the kept shell itself (``_size``).
_SHELL_READS_BYTES = 2048
_SHELL_COMMAND = f"sudo -n -- /bin/sh -c {shlex.quote(_SHELL)} tpu-portal-shell"
# The longest marker line (with its status), and how much of a stream's end is kept
# past MAX_OUTPUT_BYTES to find one.
_MARK_BYTES = 128
_SPILL_BYTES = 256
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
    # Raised by the portal whenever it forgets how it reached the worker (Disconnect,
    # a host key changed or forgotten): a connection kept from before is never used.
    generation: int = 0

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


def command_for_two(first: Script, then: Script, *, prepared: bool = False) -> str:
    """The fixed command line that runs ``first``, waits for the word, runs ``then``
    (``prepared``: runs ``then`` at once, which reads the word itself)."""
    steps = _PREPARED if prepared else _TWO_STEPS
    quoted = " ".join(shlex.quote(x) for x in (steps, first.name, then.name))
    return f"sudo -n -- /bin/sh -c {quoted}"


def framed(body: bytes) -> bytes:
    """A script as ``command_for``'s command line reads it from stdin (its data follows)."""
    return f"{len(body):010d}\n".encode() + body


def execute(
    worker: Worker,
    script: Script,
    data: bytes = b"",
    *,
    dry_run: bool | None = None,
    keep: bool = True,
) -> ScriptResult:
    """Connect to ``worker`` (or take a kept connection to it), run ``script`` with
    ``data`` on stdin, return its answer.

    Raises RemoteError (HostKeyMismatch for a host key other than the pinned one)."""
    with Connection(worker, keep=keep) as connection:
        return connection.run(script, data, dry_run=dry_run)


class Connection:
    """One SSH connection to a worker that runs scripts one after another (each sent to
    the connection's kept shell, or in a channel of its own), for work with steps on
    every worker of a VM (a job's pre-flight, then its start) that should log in once.
    Connects on the first run, or takes a connection
    kept from an earlier run to the same worker (``kept``), and gives it back there when
    closed; every check of ``execute`` applies. ``keep=False``: a connection of its own,
    made and closed here (for a check that the worker accepts the login now)."""

    def __init__(self, worker: Worker, *, keep: bool = True):
        self.worker = worker
        self.keep = keep
        self.client: paramiko.SSHClient | None = None
        # Whether ``client`` was kept from an earlier run (then it may have died idle).
        self.reused = False
        # Set by ``interrupt``: a run still connecting stops before its exec.
        self.stopped = False

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Done with it: kept for the next run to this worker, or closed."""
        client, self.client = self.client, None
        if client is None:
            return
        if not self.keep:
            client.close()
            return
        shell = getattr(client, "shell", None)
        if shell is not None and not shell.idle():
            shell.close()  # held between two steps, or ended: never lent again
        cfg = remote_config.current()
        kept.kept.give_back(
            self.key(), client, keep_seconds=cfg.keep_seconds, dead_after=cfg.connect_timeout
        )

    def drop(self) -> None:
        """Close it for good (it broke, or a run on it failed midway)."""
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def key(self) -> kept.Key:
        worker = self.worker
        return kept.Key(
            address=worker.address,
            port=worker.port,
            user=worker.login.user,
            login_key=worker.login.key.fingerprint,
            pins=worker.pins.keys,
            generation=worker.generation,
        )

    def interrupt(self) -> None:
        """From another thread: end the run in progress (it raises RemoteError, and its
        exec on the host sees the end of its stdin, or never starts when it was still
        connecting). The caller clears ``stopped`` once that run is over; the next run
        connects anew."""
        self.stopped = True
        client = self.client
        transport = client.get_transport() if client is not None else None
        if transport is not None:
            transport.close()

    def run(
        self, script: Script, data: bytes | Iterable[bytes] = b"", *, dry_run: bool | None = None
    ) -> ScriptResult:
        """Run ``script`` with ``data`` on stdin: bytes, or an iterable of chunks sent
        as they come (a large input, such as a workdir's contents, never whole in
        memory; it stops being read once the script has stopped reading)."""
        cfg = self._ready(dry_run)
        if cfg is None:
            log.info("dry run: would run %s on %s", script.name, self.worker)
            return ScriptResult(self.worker, script.name, 0, dry_run=True)
        started = time.monotonic()
        try:
            # Data of a known length goes to the connection's kept shell; a stream to an
            # exec of its own, whose end is the end of the data.
            shell = self._shell(cfg) if isinstance(data, bytes | bytearray) else None
            if shell is not None:
                status, out, err = shell.run(script, bytes(data), cfg)
                self._let_go_of(shell)
            else:
                status, out, err = self._run_exec(script, data, cfg)
        except RemoteError:
            self.drop()  # a broken connection (and its shell) is not used again
            raise
        if status != 0:
            # A login keeps the groups it was given (sudo's among them): after a script
            # that failed, perhaps for want of one the host has given the account since,
            # the next run logs in anew.
            self.drop()
        return _result(self.worker, script, status, out, err, time.monotonic() - started)

    def _run_exec(
        self, script: Script, data: bytes | Iterable[bytes], cfg: remote_config.RemoteConfig
    ) -> tuple[int, bytes, bytes]:
        """``script`` in an exec of its own: (status, stdout, stderr)."""
        run = self._exec(command_for(script), cfg)
        if isinstance(data, bytes | bytearray):
            run.send(framed(script.body) + data, last=True)
        else:
            sending = run.send(framed(script.body), last=False)
            for chunk in data if sending else ():
                if not run.send(chunk, last=False):
                    break
            run.send(b"", last=True)
        return run.finish()

    def begin(
        self,
        first: Script,
        data: bytes,
        then: Script,
        *,
        then_data: bytes | None = None,
        dry_run: bool | None = None,
    ) -> Step:
        """Run ``first`` with ``data`` and hold the host there: the returned Step says
        ``go`` (``then`` runs with its data) or stops. Raises RemoteError like ``run``;
        a first script that failed leaves nothing waiting on the host. With
        ``then_data``, ``then`` runs at once after ``first`` with that data and reads
        the word (``go`` and the Step's data) itself: it prepares while the host waits,
        and undoes that when the word is not ``go`` or never comes."""
        cfg = self._ready(dry_run)
        if cfg is None:
            log.info("dry run: would run %s then %s on %s", first.name, then.name, self.worker)
            return Step(self, None, ScriptResult(self.worker, first.name, 0, dry_run=True), then)
        started = time.monotonic()
        run = shell = None
        try:
            prepared = then_data is not None
            shell = self._shell(cfg)
            if shell is not None:
                status, out, err = shell.begin(first, data, then, then_data, cfg)
                if status is None:  # held in the shell, waiting for the word
                    run, status = shell.exec, 0
                else:  # the first script failed (or the shell ended)
                    self._let_go_of(shell)
                    shell = None
            else:
                run = self._exec(command_for_two(first, then, prepared=prepared), cfg)
                lengths = " ".join(f"{len(x):010d}" for x in (first.body, then.body, data))
                lengths = (lengths + "\n").encode()
                early = then_data if prepared else b""
                run.send(lengths + first.body + then.body + data + early, last=False)
                if run.wait_for(_STEP_DONE):
                    out, err = run.take()
                    status = 0
                else:
                    status, out, err = run.finish()
        except RemoteError:
            if run is not None:
                run.close()
            self.drop()
            raise
        result = _result(self.worker, first, status, out, err, time.monotonic() - started)
        return Step(self, run, result, then, shell=shell)

    def _ready(self, dry_run: bool | None) -> remote_config.RemoteConfig | None:
        """The door's checks before a run, then a connection; None for a dry run."""
        worker = self.worker
        check_allowed(worker)
        cfg = remote_config.current()
        if dry_run if dry_run is not None else cfg.dry_run:
            return None
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
        transport = self.client.get_transport() if self.client is not None else None
        if transport is None or not transport.is_active():
            self.drop()
            self._obtain(cfg, take=self.keep)
        self._go_on()
        return cfg

    def _obtain(self, cfg: remote_config.RemoteConfig, *, take: bool) -> None:
        """A kept connection to the worker (``take``) or a new one."""
        client = kept.kept.take(self.key()) if take else None
        self.reused = client is not None
        if client is None:
            client = _connect(self.worker, cfg)
            kept.kept.made()
        self.client = client

    def _go_on(self) -> None:
        if self.stopped:
            raise RemoteError(
                "stopped before the script began", kind=RemoteError.DISCONNECTED,
                retryable=True, worker=str(self.worker),
            )  # fmt: skip

    def _shell(self, cfg: remote_config.RemoteConfig) -> _Shell | None:
        """The root shell kept on this connection (started now when it has none, or
        the one it had ended); None where a run takes an exec of its own: the setting
        is off, the connection is not kept, or its shell is held by a Step."""
        if not (cfg.keep_shell and self.keep):
            return None
        shell = getattr(self.client, "shell", None)
        if shell is not None:
            if shell.busy:
                return None
            if shell.idle():
                return shell
            shell.close()
        run = self._exec(_SHELL_COMMAND, cfg)  # may connect anew: self.client is that one
        shell = _Shell(run, self.worker)
        self.client.shell = shell
        kept.kept.counted(shells=1)
        return shell

    def _let_go_of(self, shell: _Shell) -> None:
        """After a run on ``shell``: one that ended is forgotten with its connection's
        next run (a new one starts then)."""
        if not shell.idle() and getattr(self.client, "shell", None) is shell:
            self.client.shell = None
            shell.close()

    def _exec(self, command: str, cfg: remote_config.RemoteConfig) -> _Exec:
        """A channel running ``command``. On a kept connection the channel must open
        within the connect timeout (an idle connection to a host that hangs can look
        alive); one that fails before the command got a byte of its input is closed,
        and unless it timed out (a new connection to a hung host would only hang as
        long again) the command runs on a new connection instead, once. Nothing runs
        twice: a command that got no input does nothing."""
        if not self.reused:
            return _Exec(self.client, command, cfg.script_timeout, self.worker)
        try:
            return _Exec(
                self.client, command, cfg.script_timeout, self.worker,
                open_within=cfg.connect_timeout,
            )  # fmt: skip
        except RemoteError as exc:
            self.drop()
            if exc.kind == RemoteError.TIMEOUT:
                raise
            log.info("kept connection to %s broke (%s); connecting anew", self.worker, exc)
        self._obtain(cfg, take=False)
        self._go_on()
        return _Exec(self.client, command, cfg.script_timeout, self.worker)


class Step:
    """A host held between the two scripts of ``Connection.begin``: ``result`` is the
    first script's answer; ``go`` runs the second, ``stop`` (or nothing, once the
    connection closes) ends the run on the host with nothing more done."""

    def __init__(
        self,
        connection: Connection,
        run: _Exec | None,
        result: ScriptResult,
        then,
        *,
        shell: _Shell | None = None,
    ):
        self.connection = connection
        self.run = run
        self.result = result
        self.then = then
        # The kept shell the host waits in (``run`` is its channel), or None: an exec.
        self.shell = shell

    def go(self, data: bytes = b"") -> ScriptResult:
        worker, run = self.connection.worker, self.run
        if self.result.dry_run:
            return ScriptResult(worker, self.then.name, 0, dry_run=True)
        if run is None:
            raise RemoteError(
                "the host is no longer waiting for the word", kind=RemoteError.DISCONNECTED,
                retryable=True, worker=str(worker),
            )  # fmt: skip
        self.run = None
        started = time.monotonic()
        try:
            if self.shell is not None:
                shell, self.shell = self.shell, None
                status, out, err = shell.go(data)
                self.connection._let_go_of(shell)
            else:
                run.restart_clock()
                run.send(b"go\n" + data, last=True)
                status, out, err = run.finish()
        except RemoteError:
            self.connection.drop()
            raise
        return _result(worker, self.then, status, out, err, time.monotonic() - started)

    def stop(self) -> None:
        """End of stdin without the word: the host exits without running ``then`` (a
        kept shell held here ends with it; the connection's next run starts another)."""
        run, self.run = self.run, None
        shell, self.shell = self.shell, None
        if shell is not None:
            shell.close()
        elif run is not None:
            run.close()


def _result(
    worker: Worker, script: Script, status: int, out: bytes, err: bytes, elapsed: float
) -> ScriptResult:
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


def _transport(sock, *, host_key_types: tuple[str, ...] = (), **kwargs) -> paramiko.Transport:
    """paramiko's Transport with the key exchanges in the door's order of preference, and
    the pinned host key types asked for first."""
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    known = list(options.kex)
    first = [name for name in _KEX_ORDER if name in known]
    options.kex = first + [name for name in known if name not in first]
    offered = list(options.key_types)
    wanted = [name for name in host_key_types if name in offered]
    options.key_types = wanted + [name for name in offered if name not in wanted]
    return transport


class _PinnedHostKeys(paramiko.MissingHostKeyPolicy):
    """Lets in a host that presents one of the pinned keys, and no other. paramiko's own
    known-hosts check holds one key per type and host, so of two pinned keys of one type
    (a host's old and new key while it is pinned anew) it would accept only one."""

    def __init__(self, worker: Worker):
        self.keys = worker.pins.paramiko_keys()
        self.pinned = {(key.get_name(), key.get_base64()) for key in self.keys}

    def missing_host_key(self, client, hostname, key) -> None:
        if (key.get_name(), key.get_base64()) not in self.pinned:
            same_type = [k for k in self.keys if k.get_name() == key.get_name()]
            raise paramiko.BadHostKeyException(hostname, key, (same_type or self.keys)[0])


def _host_key_types(keys: list[paramiko.PKey]) -> tuple[str, ...]:
    """The host key algorithms that prove the pinned keys, in the pins' order (an RSA
    key signs with SHA-2, never SHA-1)."""
    types: list[str] = []
    for key in keys:
        name = key.get_name()
        names = ["rsa-sha2-512", "rsa-sha2-256"] if name == "ssh-rsa" else [name]
        types += [n for n in names if n not in types]
    return tuple(types)


def _connect(worker: Worker, cfg: remote_config.RemoteConfig) -> paramiko.SSHClient:
    client = _Client()
    policy = _PinnedHostKeys(worker)
    client.set_missing_host_key_policy(policy)
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
            transport_factory=functools.partial(
                _transport, host_key_types=_host_key_types(policy.keys)
            ),
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


class _Client(paramiko.SSHClient):
    """An SSH connection, and the root shell kept open on it (None until a run starts
    one): the shell goes wherever the connection goes, and ends with it."""

    shell: _Shell | None = None


def _size(data: bytes) -> str:
    """How the kept shell is to read ``data``: ``l<count>``, that many lines it reads
    itself (no program; its ``read`` takes a byte a system call, so only short text
    ending in a newline, without NUL bytes), or the number of bytes, for ``head -c``."""
    if 0 < len(data) <= _SHELL_READS_BYTES and data.endswith(b"\n") and b"\0" not in data:
        return f"l{data.count(bytes([10]))}"
    return str(len(data))


class _Shell:
    """A root shell kept open on one channel of a connection, to which each run sends
    its request (module docstring). Lent with its connection, to one run at a time;
    ``busy`` while a run or a Step holds it. A run that fails in any way other than its
    script's own status closes it (and its connection: ``Connection.drop``)."""

    def __init__(self, run: _Exec, worker: Worker):
        self.exec = run
        self.worker = worker
        self.busy = False
        self.runs = 0  # requests answered
        self.known: set[str] = set()  # digests of the scripts it keeps
        self.nonce = ""
        self.prepared = False

    def idle(self) -> bool:
        """Not held, and alive as far as can be seen from here."""
        channel = self.exec.channel
        return not (
            self.busy
            or channel is None
            or channel.closed
            or channel.eof_received
            or channel.exit_status_ready()
        )

    def close(self) -> None:
        self.busy = False
        self.exec.close()

    def run(self, script: Script, data: bytes, cfg: remote_config.RemoteConfig):
        """Run ``script`` with ``data``: (status, stdout, stderr)."""
        self._send("r", data, [script], b"", cfg)
        return self._read_end()

    def begin(
        self,
        first: Script,
        data: bytes,
        then: Script,
        then_data: bytes | None,
        cfg: remote_config.RemoteConfig,
    ):
        """Run ``first`` and hold ``then`` (``Connection.begin``): (None, stdout, stderr)
        once the host waits for the word, or the status the run ended with."""
        self.prepared = then_data is not None
        kind = "p" if self.prepared else "t"
        self._send(kind, data, [first, then], then_data or b"", cfg)
        found = self.exec.read_to(
            self._mark(rb"(step|end)", rb"(?: ([0-9]{1,3}))?\n"), self._mark(rb"(?:step|end)")
        )
        if found is None:
            self.busy = False
            return self.exec.finish()
        (out, out_mark), (err, _) = found
        if out_mark[0] == b"step":
            return None, out, err
        self.busy = False
        self.runs += 1
        return int(out_mark[1]), out, err

    def go(self, data: bytes):
        """The word to a host held by ``begin``: (status, stdout, stderr) of ``then``."""
        payload = b"go\n" + data if self.prepared else data
        self.exec.restart_clock()
        self.exec.send(f"go {_size(payload)}\n".encode() + payload, last=False)
        return self._read_end()

    def _send(self, kind: str, data: bytes, scripts: list[Script], more: bytes, cfg) -> None:
        """One request; then the shell's run markers (from a shell that answered before,
        within the connect timeout: a host that stopped answering is found out as soon
        as a new channel would have been)."""
        self.busy = True
        self.nonce = secrets.token_hex(16)
        kept.kept.counted(shell_runs=1)
        fields, bodies = [kind, self.nonce, _size(data)], []
        for script in scripts:
            digest = hashlib.sha256(script.body).hexdigest()
            body = b"" if digest in self.known else script.body
            fields += [digest, str(len(body))]
            bodies.append(body)
            self.known.add(digest)
        if kind != "r":
            fields.append(_size(more))
        request = " ".join(fields).encode() + b"\n" + b"".join(bodies) + data + more
        self.exec.timeout = cfg.script_timeout  # today's, not the one it started under
        self.exec.restart_clock()
        self.exec.send(request, last=False)
        # What came before the markers is no run's (late output of an earlier run's
        # leftover process). A shell that ended instead: _read_end finds it ended too.
        self.exec.read_to(
            self._mark(rb"run"), self._mark(rb"run"),
            within=cfg.connect_timeout if self.runs else 0,
        )  # fmt: skip

    def _read_end(self) -> tuple[int, bytes, bytes]:
        found = self.exec.read_to(self._mark(rb"end", rb" ([0-9]{1,3})\n"), self._mark(rb"end"))
        self.busy = False
        if found is None:
            return self.exec.finish()
        self.runs += 1
        (out, out_mark), (err, _) = found
        return int(out_mark[0]), out, err

    def _mark(self, what: bytes, tail: bytes = rb"\n") -> re.Pattern[bytes]:
        """A marker line of this request (its nonce: no script can print it)."""
        return re.compile(rb"tpu-portal-" + what + rb"-" + self.nonce.encode() + tail)


class _Exec:
    """One channel running one command: send its stdin, read both streams (interleaved,
    so a chatty stderr cannot stall the window), wait for a marker line or the exit
    status, within ``timeout``. Every failure is a RemoteError."""

    def __init__(
        self,
        client: paramiko.SSHClient,
        command: str,
        timeout: float,
        worker: Worker,
        *,
        open_within: float | None = None,
    ):
        self.worker = worker
        self.timeout = timeout
        self.out, self.err = bytearray(), bytearray()
        # Past MAX_OUTPUT_BYTES, the last bytes read of each stream (where a marker of
        # ``read_to`` may be), and how far each stream was looked through for one.
        self.spill = [b"", b""]
        self.scanned = [0, 0]
        # None until the channel is open: a connection that broke before (the host
        # went away between the login and the exec) has nothing to close.
        self.channel: paramiko.Channel | None = None
        self.restart_clock()
        with self._errors():
            transport = client.get_transport()
            if transport is None or not transport.is_active():
                raise paramiko.SSHException("the connection closed before the script began")
            try:
                self.channel = transport.open_session(timeout=open_within or self._left(1.0))
            except paramiko.SSHException as exc:
                if open_within is None or "Timeout" not in str(exc):
                    raise
                raise RemoteError(
                    f"the host did not open a channel within {open_within:.0f} s",
                    kind=RemoteError.TIMEOUT, retryable=True, worker=str(worker),
                ) from None  # fmt: skip
            self.channel.settimeout(self._left(0.1))
            self.channel.exec_command(command)

    def restart_clock(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        if self.channel is not None:
            self.channel.settimeout(self._left(0.1))

    def _left(self, least: float) -> float:
        return max(least, self.deadline - time.monotonic())

    def send(self, data: bytes, *, last: bool) -> bool:
        """False once the command stopped reading (it exited; its status tells why)."""
        with self._errors():
            try:
                if data:
                    self.channel.sendall(data)
                if last:
                    self.channel.shutdown_write()
            except OSError:
                return False  # the command exited without reading all of it
        return True

    def wait_for(self, marker: bytes) -> bool:
        """Read until a line of stdout is ``marker`` (True; what came before it is the
        answer so far) or the command ended (False)."""
        with self._errors():
            while True:
                if self.out.startswith(marker) or b"\n" + marker in self.out:
                    cut = self.out.rfind(marker)
                    del self.out[cut:]
                    return True
                if not self._pump():
                    return False

    def finish(self) -> tuple[int, bytes, bytes]:
        """Read to the end; the exit status and both streams."""
        with self._errors():
            while self._pump():
                pass
            channel = self.channel
            # Output that arrived together with the exit status.
            self._drain()
            status = channel.exit_status if channel.exit_status_ready() else -1
        if status == -1:
            raise RemoteError(
                "the script ended without an exit status (killed, or the host went away)",
                kind=RemoteError.DISCONNECTED,
                retryable=True,
                worker=str(self.worker),
                stderr=self.err.decode(errors="replace")[-4000:],
            )
        return status, bytes(self.out), bytes(self.err)

    def read_to(
        self, out_mark: re.Pattern[bytes], err_mark: re.Pattern[bytes], *, within: float = 0
    ) -> tuple[tuple[bytes, tuple], tuple[bytes, tuple]] | None:
        """Read until stdout has ``out_mark`` and stderr ``err_mark``: for each stream,
        what came before the marker and its groups (what came after it stays for the
        next read). None once the command ended without both (``finish`` tells how).
        ``within``: the markers must come within that many seconds (else TIMEOUT)."""
        found: list[tuple[bytes, tuple] | None] = [None, None]
        marks = (out_mark, err_mark)
        deadline = self.deadline
        if within:
            self.deadline = min(deadline, time.monotonic() + within)
        try:
            with self._errors():
                try:
                    while True:
                        for stream, mark in enumerate(marks):
                            found[stream] = found[stream] or self._cut(stream, mark)
                        if found[0] and found[1]:
                            return found[0], found[1]
                        if not self._pump():
                            self._drain()
                            for stream, mark in enumerate(marks):
                                found[stream] = found[stream] or self._cut(stream, mark)
                            return (found[0], found[1]) if found[0] and found[1] else None
                except TimeoutError:
                    if not within or time.monotonic() >= deadline:
                        raise
                    self.close()
                    raise RemoteError(
                        f"the host did not answer within {within:.0f} s",
                        kind=RemoteError.TIMEOUT, retryable=True, worker=str(self.worker),
                    ) from None  # fmt: skip
        finally:
            self.deadline = deadline

    def _cut(self, stream: int, mark: re.Pattern[bytes]) -> tuple[bytes, tuple] | None:
        """The first ``mark`` in a stream: what came before it, and the marker's groups;
        the stream keeps what came after it."""
        buffer, spill = (self.out, self.err)[stream], self.spill[stream]
        if not spill:
            found = mark.search(buffer, max(0, self.scanned[stream] - _MARK_BYTES))
            self.scanned[stream] = len(buffer)
            if found is None:
                return None
            before, after = bytes(buffer[: found.start()]), bytes(buffer[found.end() :])
        else:
            # Past the cap: the marker is at the end of what was read (the last of the
            # buffer and the spill together, when it came just at the cap).
            edge = bytes(buffer[-_MARK_BYTES:])
            found = mark.search(edge + spill)
            if found is None:
                return None
            before = bytes(buffer[: len(buffer) - len(edge) + min(found.start(), len(edge))])
            after = (edge + spill)[found.end() :]
        groups = found.groups()  # (the match would read the buffer as it is changed)
        buffer[:] = after
        self.spill[stream] = b""
        self.scanned[stream] = 0
        return before, groups

    def take(self) -> tuple[bytes, bytes]:
        """Both streams so far, emptied (for the next step's answer)."""
        out, err = bytes(self.out), bytes(self.err)
        self.out.clear()
        self.err.clear()
        return out, err

    def close(self) -> None:
        if self.channel is None:
            return
        with contextlib.suppress(paramiko.SSHException, OSError, EOFError):
            self.channel.close()  # what may be broken already

    def _pump(self) -> bool:
        """Read what is there or wait for more; False once the command has ended."""
        channel = self.channel
        if channel.recv_ready():
            self._got(0, channel.recv(65536))
            return True
        if channel.recv_stderr_ready():
            self._got(1, channel.recv_stderr(65536))
            return True
        # The exit status can overtake the last of the output (it waits for window
        # space we free by reading): stop only once the host also sent EOF.
        if channel.closed or (channel.exit_status_ready() and channel.eof_received):
            return False
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if channel.eof_received:
            channel.status_event.wait(min(remaining, 1.0))
        else:
            select.select([channel], [], [], min(remaining, 1.0))
        return True

    @contextlib.contextmanager
    def _errors(self):
        where = str(self.worker)
        try:
            yield
        except TimeoutError:
            self.close()
            raise RemoteError(
                f"the script did not finish within {self.timeout:.0f} s",
                kind=RemoteError.TIMEOUT,
                retryable=True,
                worker=where,
                script_ran_late=True,
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self.close()
            raise RemoteError(
                f"the connection broke while the script ran: {exc}",
                kind=RemoteError.DISCONNECTED,
                retryable=True,
                worker=where,
            ) from None

    def _drain(self) -> None:
        """Output that arrived together with the exit status."""
        channel = self.channel
        while channel.recv_ready():
            self._got(0, channel.recv(65536))
        while channel.recv_stderr_ready():
            self._got(1, channel.recv_stderr(65536))

    def _got(self, stream: int, chunk: bytes) -> None:
        """Kept up to MAX_OUTPUT_BYTES; of the rest, read and dropped, only the last
        bytes (where a marker may be)."""
        buffer = (self.out, self.err)[stream]
        room = max(0, MAX_OUTPUT_BYTES - len(buffer))
        if room:
            buffer += chunk[:room]
        if len(chunk) > room:
            self.spill[stream] = (self.spill[stream] + chunk[room:])[-_SPILL_BYTES:]

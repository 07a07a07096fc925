"""The one error type of the remote door, and whether retrying can help."""

from __future__ import annotations


class RemoteError(Exception):
    """A script could not be run on a worker, or it failed there.

    ``retryable`` says whether running the same script again later can help (the host
    was unreachable, timed out, went away mid-run); ``kind`` names the failure for logs,
    the audit trail and the page.
    """

    UNREACHABLE = "unreachable"  # refused, no route, reset before SSH started
    TIMEOUT = "timeout"  # connect, handshake, auth or the script took too long
    DISCONNECTED = "disconnected"  # the connection or the script ended without a status
    PROTOCOL = "protocol"  # the SSH handshake failed in another way
    NO_PIN = "no_pin"  # we hold no host key for this worker: never connect blind
    NOT_ALLOWED = "not_allowed"  # the address is outside the allowed networks
    HOST_KEY = "host_key"  # the worker presented a host key other than the pinned one
    AUTH = "auth"  # the worker refused the admin key
    SCRIPT = "script"  # the script ran and exited non-zero

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        retryable: bool,
        worker: str = "",
        exit_status: int | None = None,
        stderr: str = "",
        script_ran_late: bool = False,
    ):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.retryable = retryable
        self.worker = worker
        self.exit_status = exit_status
        self.stderr = stderr
        # A TIMEOUT of the script itself (it ran on the host and did not finish in
        # time), not of reaching the host: trying again would likely take as long.
        self.script_ran_late = script_ran_late

    def __str__(self) -> str:
        where = f"{self.worker}: " if self.worker else ""
        return f"{where}{self.message}"


class HostKeyMismatch(RemoteError):
    """The worker's host key is not the pinned one: stop, run nothing, tell the lab's
    admins. Never retryable: only an admin who confirms the new key can fix it."""

    def __init__(self, message: str, *, worker: str = "", presented: str = ""):
        super().__init__(message, kind=RemoteError.HOST_KEY, retryable=False, worker=worker)
        # The key the host showed, as "<type> <base64>", for the admins' alert.
        self.presented = presented

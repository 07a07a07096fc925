"""The one door to TPU VM workers over SSH; the only code that imports paramiko.

Connects by a worker's current address with its pinned host keys (RejectPolicy, never
trust on first use), the lab's own key (``Login``), explicit timeouts, no agent and no
key files looked up; runs scripts that ship in ``scripts/`` with their data on stdin;
raises one error type, RemoteError, that says whether a retry can help.
"""

from tpus.remote.config import Login, site_login
from tpus.remote.errors import HostKeyMismatch, RemoteError
from tpus.remote.fanout import Held, Sessions, WorkerOutcome, run_on_workers, run_script
from tpus.remote.kept import forget as forget_kept
from tpus.remote.pins import HostKeyPins, InvalidHostKey
from tpus.remote.scan import scan_host_keys
from tpus.remote.scripts import Script
from tpus.remote.ssh import ScriptResult, Worker

__all__ = [
    "Held",
    "HostKeyMismatch",
    "HostKeyPins",
    "InvalidHostKey",
    "Login",
    "RemoteError",
    "Script",
    "ScriptResult",
    "Sessions",
    "Worker",
    "WorkerOutcome",
    "forget_kept",
    "run_on_workers",
    "run_script",
    "scan_host_keys",
    "site_login",
]

"""Reading a worker's SSH host keys without logging in, for an admin to confirm.

This is the only way the portal learns a host key other than guest attributes, and it
never pins anything by itself: the admin compares the fingerprints with what the VM's
console shows and confirms them.
"""

from __future__ import annotations

import paramiko
from django.conf import settings

from tpus.remote.errors import RemoteError
from tpus.remote.ssh import Worker, check_allowed, open_socket

SCAN_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "rsa-sha2-512")


def scan_host_keys(address: str, port: int = 22) -> list[str]:
    """The host keys the server at ``address`` offers, as ``"type base64"`` lines."""
    check_allowed(Worker(address=address, pins=None, port=port))  # type: ignore[arg-type]
    timeout = float(settings.PORTAL_REMOTE_CONNECT_TIMEOUT)
    found = []
    for key_type in SCAN_TYPES:
        try:
            sock = open_socket(address, port, timeout)
        except OSError as exc:
            raise RemoteError(
                f"cannot connect to {address}:{port}: {exc}",
                kind=RemoteError.UNREACHABLE,
                retryable=True,
                worker=address,
            ) from None
        transport = paramiko.Transport(sock)
        try:
            transport.get_security_options().key_types = [key_type]
            transport.start_client(timeout=timeout)
            key = transport.get_remote_server_key()
            found.append(f"{key.get_name()} {key.get_base64()}")
        except (paramiko.SSHException, OSError, EOFError):
            continue  # the server has no key of this type
        finally:
            transport.close()
    if not found:
        raise RemoteError(
            f"{address}:{port} offered no usable host key",
            kind=RemoteError.PROTOCOL,
            retryable=True,
            worker=address,
        )
    return sorted(set(found))

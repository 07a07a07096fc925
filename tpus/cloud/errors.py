"""The one error the Cloud TPU door raises, and how library errors become it."""

from __future__ import annotations

import concurrent.futures

from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions

# Status codes where trying again later can succeed.
RETRYABLE = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL", "ABORTED"}
)


class CloudError(Exception):
    """A Cloud TPU API call failed.

    ``code`` is the gRPC status name (``NOT_FOUND``, ``PERMISSION_DENIED``, ...);
    ``retryable`` says whether the same call can succeed later without anyone
    changing anything. ``str(error)`` is written for a lab admin to read.
    """

    def __init__(self, message: str, *, code: str, retryable: bool, method: str = ""):
        super().__init__(message)
        self.message = message
        self.code = code
        self.retryable = retryable
        self.method = method

    def __repr__(self) -> str:
        return f"CloudError({self.message!r}, code={self.code!r}, retryable={self.retryable})"


_HINTS = {
    "PERMISSION_DENIED": "the portal's credentials may not do this in that project; "
    "grant its service account roles/tpu.admin (or tpu.viewer to read)",
    "UNAUTHENTICATED": "the portal's Google credentials are missing or invalid "
    "(TPU_API_CREDENTIALS_FILE or application default credentials)",
    "NOT_FOUND": "no such resource in that project and zone, or it was deleted",
    "RESOURCE_EXHAUSTED": "quota or rate limit reached; try again later",
    "UNAVAILABLE": "the Cloud TPU API is unreachable right now; try again later",
    "DEADLINE_EXCEEDED": "the Cloud TPU API did not answer in time; try again later",
}


def to_cloud_error(method: str, exc: BaseException) -> CloudError | None:
    """Map a failure of a call to ``method`` onto CloudError; None when ``exc`` is not
    a failure of the outside system (a bug of ours must stay a bug)."""
    if isinstance(exc, CloudError):
        return exc
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        code = exc.grpc_status_code.name if exc.grpc_status_code is not None else "UNKNOWN"
        detail = exc.message or str(exc)
    elif isinstance(exc, api_exceptions.RetryError):
        code, detail = "DEADLINE_EXCEEDED", str(exc)
    elif isinstance(exc, concurrent.futures.TimeoutError):
        code, detail = "DEADLINE_EXCEEDED", "the operation did not finish in time"
    elif isinstance(exc, auth_exceptions.DefaultCredentialsError | auth_exceptions.RefreshError):
        code, detail = "UNAUTHENTICATED", str(exc)
    elif isinstance(exc, auth_exceptions.TransportError):
        code, detail = "UNAVAILABLE", str(exc)
    else:
        return None
    hint = _HINTS.get(code)
    message = f"Cloud TPU API {method} failed: {code}: {detail}"
    if hint:
        message += f" ({hint})"
    return CloudError(message, code=code, retryable=code in RETRYABLE, method=method)

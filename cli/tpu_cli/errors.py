"""One error type for everything the client refuses or cannot do, carrying the exit
code the command ends with."""

from __future__ import annotations

# Exit codes (``tpu --help`` lists them). ``tpu run`` ends with the job's own exit code
# when the job has one.
OK = 0
FAILED = 1  # the thing ran and failed: a worker in `tpu exec`, a job without an exit code
USAGE = 2  # bad input: arguments, a VM name, a workdir, what the portal refused as input
SIGNED_OUT = 3  # not signed in, or the sign-in ended (expired or revoked token)
NOT_FOUND = 4  # no such VM or job, or no access to it
UNREACHABLE = 5  # the portal cannot be reached, or answered with a server error
INTERRUPTED = 130  # Ctrl-C (a followed job goes on)


class CliError(Exception):
    """A message for the person and the exit code to end with."""

    def __init__(self, message: str, code: int = FAILED):
        super().__init__(message)
        self.message = message
        self.code = code


class ApiError(CliError):
    """The portal answered with an error; ``detail`` is its own sentence."""

    def __init__(self, status: int, detail: str, errors: dict | None = None):
        if status in (403, 404):
            code = NOT_FOUND
        elif status >= 500:
            code = UNREACHABLE
        else:
            code = USAGE
        super().__init__(detail, code)
        self.status = status
        self.detail = detail
        self.errors = errors or {}
        self.error_code = ""
        # The whole JSON answer, when it was an object (fields beyond ``detail``).
        self.body: dict = {}

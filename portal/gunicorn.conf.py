"""Gunicorn settings for production: ``gunicorn -c portal/gunicorn.conf.py portal.wsgi``.

Read from the environment (gunicorn loads this file before Django, so it parses them
itself, failing as loudly as the portal's own settings do):

- ``PORTAL_BIND``: address to listen on, ``host:port`` or ``unix:/path``; default
  ``127.0.0.1:8000``, behind a TLS-terminating proxy on the same machine.
- ``PORTAL_WEB_WORKERS``: worker processes; default 2 × usable CPUs + 1.
- ``PORTAL_WEB_TIMEOUT``: seconds a request may take before its worker is replaced;
  default 60, above the Cloud TPU API's 30-second call timeout that some pages wait on.
"""

import os

from gunicorn.glogging import Logger


def _integer(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"{name} must be a whole number of at least 1, not {value!r}.")
    return int(value)


bind = [os.environ.get("PORTAL_BIND", "").strip() or "127.0.0.1:8000"]
# One request per worker process; the TLS proxy in front buffers slow clients.
worker_class = "sync"
workers = _integer("PORTAL_WEB_WORKERS", 2 * len(os.sched_getaffinity(0)) + 1)
timeout = _integer("PORTAL_WEB_TIMEOUT", 60)
# On stop or reload, requests in flight get this long to finish.
graceful_timeout = 30
# Recycle workers now and then so a slow leak cannot grow without bound.
max_requests = 2000
max_requests_jitter = 200


class AccessLogWithoutFeedTokens(Logger):
    """gunicorn's logger, with the ssh-config refresh URL's token replaced in every
    field of an access log line (request line, path, referer, headers), as the
    portal's own request logs do."""

    def atoms(self, resp, req, environ, request_time):
        # Imported here: this file is read before gunicorn puts the project on sys.path,
        # and access lines are only written by workers, which have loaded the portal.
        from portal.logs import redact

        atoms = super().atoms(resp, req, environ, request_time)
        return {k: redact(v) if isinstance(v, str) else v for k, v in atoms.items()}


logger_class = AccessLogWithoutFeedTokens
accesslog = "-"  # stdout: journald or the container runtime keeps it
errorlog = "-"  # stderr
# Several portals (or a test run beside a deployment) on one machine must not share
# gunicorn's default control socket in $HOME; signals are enough to manage it.
control_socket_disable = True

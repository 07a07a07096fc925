"""Logging filters for secrets that travel in URLs.

The ssh-config refresh URL carries a token that works like a password
(``/ssh/feed/<token>/config``). Request logs (``django.server``, ``django.request``)
show the path with the token replaced, so log files and log shippers never hold it.
"""

from __future__ import annotations

import logging
import re

# The token is the path segment between /ssh/feed/ and the file name.
FEED_TOKEN = re.compile(r"(/ssh/feed/)[^/\s\"'?#]+(?=/(?:config|known_hosts)\b)")
REDACTED = "[redacted]"


def redact(text: str) -> str:
    return FEED_TOKEN.sub(r"\1" + REDACTED, text)


class RedactFeedTokens(logging.Filter):
    """Rewrites a record whose message holds a refresh-URL token; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


class QuietPermissionDenied(logging.Filter):
    """An ordinary 403 (a person asked for something they may not do) is logged as one
    line, without the traceback Django attaches: it is not a fault of the portal."""

    def filter(self, record: logging.LogRecord) -> bool:
        from django.core.exceptions import PermissionDenied

        if record.exc_info and isinstance(record.exc_info[1], PermissionDenied):
            record.exc_info, record.exc_text = None, None
        return True

"""Mail on a developer's machine (``portal.settings.local``): no SMTP server, so every
message is printed on the console that runs the portal, framed and decoded so a link
can be copied from it even among the worker's log lines, and kept as a file of its
own in ``EMAIL_FILE_PATH`` (``var/mail/``), where it is easy to find again. The pages
that say "we sent you an email" tell where it went (``where_mail_goes``)."""

from __future__ import annotations

import re
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.core.mail.backends.base import BaseEmailBackend

BACKEND = "portal.localmail.ConsoleAndFileBackend"
_CONSOLE = "django.core.mail.backends.console.EmailBackend"
_FILE = "django.core.mail.backends.filebased.EmailBackend"
_RULE = "=" * 72
_lock = threading.Lock()


def where_mail_goes() -> str:
    """Where this portal's mail ends up when it is not sent anywhere, as the end of the
    sentence "the message was …"; empty when mail goes to an SMTP server (or is kept
    in memory by tests)."""
    backend = settings.EMAIL_BACKEND
    if backend == BACKEND:
        return (
            "printed on the console that runs the portal (bin/portal) and saved as a file"
            f" in {_shown(settings.EMAIL_FILE_PATH)}"
        )
    if backend == _CONSOLE:
        return "printed on the console that runs the portal"
    if backend == _FILE:
        return f"saved as a file in {_shown(settings.EMAIL_FILE_PATH)}"
    return ""


def _shown(path) -> str:
    """A folder under the checkout as the README names it (``var/mail/``)."""
    path = Path(path)
    try:
        return f"{path.relative_to(settings.BASE_DIR)}/"
    except ValueError:
        return f"{path}/"


class ConsoleAndFileBackend(BaseEmailBackend):
    """Prints each message's headers and plain text between rules on stdout and
    writes the whole message (``.eml``) to its own file in ``EMAIL_FILE_PATH``."""

    def __init__(self, *args, file_path=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.folder = Path(file_path or settings.EMAIL_FILE_PATH)

    def send_messages(self, email_messages) -> int:
        sent = 0
        for message in email_messages:
            path = self._save(message)
            self._print(message, path)
            sent += 1
        return sent

    def _save(self, message) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-%f")
        who = re.sub(r"[^A-Za-z0-9@._-]", "_", (message.to or ["nobody"])[0])[:80]
        path = self.folder / f"{stamp}-{who}.eml"
        path.write_bytes(message.message().as_bytes(linesep="\n"))
        return path

    def _print(self, message, path: Path) -> None:
        body = message.body
        if getattr(message, "content_subtype", "plain") == "html":
            body = "(an HTML message: open the file to read it)"
        text = "\n".join(
            [
                "",
                _RULE,
                f"Email to {', '.join(message.to)}",
                f"Subject: {message.subject}",
                f"Saved as {path}",
                "-" * 72,
                body.rstrip(),
                _RULE,
                "",
            ]
        )
        with _lock:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

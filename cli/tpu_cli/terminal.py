"""Text from the workers made safe to show in the person's terminal: a job's log may be
another person's output (a lab admin reads everyone's), and escape sequences in it
could retitle the window, rewrite what the screen shows, or write to the clipboard."""

from __future__ import annotations

import re

_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, screen clears
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: window title, clipboard, links
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC, up to the string end
    r"|\x1b[ -/]*[0-~]"  # any other escape sequence
    r"|\x9b[0-?]*[ -/]*[@-~]"  # the same as 8-bit controls
    r"|\x9d[^\x07\x9c]*[\x07\x9c]?"
    r"|[\x90\x98\x9e\x9f][^\x9c]*\x9c?"
)
# Control characters but tab (and the line's end), and the bidirectional overrides that
# make text read otherwise than it is.
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean_line(line: str) -> str:
    """One line as a terminal would end up showing it, without what it would do: escape
    sequences and control characters removed (tabs kept), and of a line a progress bar
    rewrote with carriage returns, its last state."""
    line = _ESCAPES.sub("", line)
    if "\r" in line:
        parts = [part for part in line.split("\r") if part]
        line = parts[-1] if parts else ""
    return _CONTROLS.sub("", line)


def clean_lines(text: str) -> list[str]:
    """``text``'s lines, each ``clean_line``."""
    return [clean_line(line) for line in text.split("\n")[: -1 if text.endswith("\n") else None]]

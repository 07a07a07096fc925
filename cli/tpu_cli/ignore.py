"""The files of a workdir that a job gets: what ``rsync -a --filter=':- .gitignore'
--exclude=/.git`` sends to a named VM, chosen here without rsync for a job on any VM of
a kind (``tpu run --type … --workdir``), so both ways ship the same files.

rsync reads every ``.gitignore`` (even one it leaves out) as a list of exclude
patterns for its folder and everything below it, with its own pattern rules, which
are not quite git's:

- ``#`` and ``;`` lines are comments, blank lines are skipped; nothing else is
  trimmed (a trailing space is part of the name; ``\r\n`` ends a line as ``\n`` does);
- ``!`` is not git's re-include: ``!keep.log`` leaves out a file named ``!keep.log``;
- ``/x`` is anchored to the folder of its ``.gitignore``; ``x/`` matches folders only;
- a pattern without a slash (or ``**``) matches a name at any depth; one with a slash
  matches the end of the path from the workdir (``a/b`` leaves out ``a/b`` and
  ``x/a/b``);
- ``*`` and ``?`` stop at ``/``, ``**`` does not (``a/**/b`` needs a folder between
  them), ``**/x`` matches ``x`` at the top too, ``[...]`` with ``!``/``^``, and in a
  pattern with one of these, ``\\`` quotes the next character;
- a folder left out is left out with everything in it.

Only regular files are taken. A symlink to a regular file inside the workdir is
followed (the file's content goes under the link's name); any other symlink (to a
folder, out of the workdir, or to nothing) is left out and named. Sockets, pipes and
devices are left out.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

IGNORE_FILE = ".gitignore"

# rsync's [:class:] names, as Python character class parts.
_CLASSES = {
    "alnum": "a-zA-Z0-9", "alpha": "a-zA-Z", "blank": " \\t", "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~",
    "punct": "!-/:-@\\[-`{-~", "space": " \\t\\n\\r\\f\\v", "upper": "A-Z",
    "xdigit": "0-9A-Fa-f",
}  # fmt: skip


def _class(pattern: str, at: int) -> tuple[str, int] | None:
    """The regex of the ``[...]`` at ``pattern[at]`` and where it ends, or None when it
    does not close (then ``[`` is an ordinary character)."""
    i = at + 1
    negate = i < len(pattern) and pattern[i] in "!^"
    if negate:
        i += 1
    parts, first = [], True
    while i < len(pattern):
        c = pattern[i]
        if c == "]" and not first:
            body = "".join(parts)
            return (f"[^/{body}]" if negate else f"[{body}]"), i + 1
        first = False
        if c == "[" and pattern.startswith("[:", i):
            end = pattern.find(":]", i + 2)
            if end > 0 and pattern[i + 2 : end] in _CLASSES:
                parts.append(_CLASSES[pattern[i + 2 : end]])
                i = end + 2
                continue
        if c == "\\" and i + 1 < len(pattern):
            i += 1
            c = pattern[i]
        if c == "-" and parts and i + 1 < len(pattern) and pattern[i + 1] != "]":
            parts.append("-")
        else:
            parts.append(re.escape(c))
        i += 1
    return None


def _regex(pattern: str) -> str:
    """``pattern`` as rsync matches it: a pattern without ``*``, ``?`` or ``[`` is the
    name as written (a backslash too); with one, ``\\`` quotes the next character."""
    if not any(c in pattern for c in "*?["):
        return re.escape(pattern)
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
        elif c == "*":
            stars = len(pattern[i:]) - len(pattern[i:].lstrip("*"))
            out.append(".*" if stars > 1 else "[^/]*")
            i += stars
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (found := _class(pattern, i)) is not None:
            out.append(found[0])
            i = found[1]
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class Rule:
    """One exclude pattern of a ``.gitignore``, as rsync matches it."""

    text: str
    dir_only: bool
    anchored: bool
    # How much of the path the pattern is held against: 0 the whole path (anchored,
    # or a leading ``**/``), N its last N names, -1 the path from any folder on.
    where: int
    # The name alone (no slash, no ``**``).
    name_only: bool
    lead_slash: bool  # ``**/x``: "/" before the path, so it matches at the top too
    dir_slash: bool  # ``x/***``: "/" after a folder's path, so it matches the folder
    regex: re.Pattern

    @classmethod
    def parse(cls, line: str, folder: str) -> Rule | None:
        """The rule of one line of the ``.gitignore`` in ``folder`` (its path from the
        workdir, "" at the top); None for a comment or a blank line."""
        if not line or line[0] in "#;":
            return None
        dir_only = line.endswith("/") and len(line) > 1
        text = line.rstrip("/") if dir_only else line
        anchored = text.startswith("/")
        if anchored:
            text = (f"/{folder}" if folder else "") + text
        pattern = text[1:] if anchored else text
        wild2 = "**" in pattern
        lead = not anchored and pattern.startswith("**/")
        slashes = pattern.count("/")
        if anchored or lead:
            where = 0
        elif slashes and not wild2:
            where = slashes + 1
        elif wild2:
            where = -1
        else:
            where = 0
        return cls(
            text=line, dir_only=dir_only, anchored=anchored, where=where,
            name_only=not anchored and not slashes and not wild2, lead_slash=lead,
            dir_slash=pattern.endswith("/***"), regex=re.compile(_regex(pattern), re.DOTALL),
        )  # fmt: skip

    def matches(self, path: str, is_dir: bool) -> bool:
        """Whether the rule leaves out ``path`` (from the workdir, "/"-separated)."""
        if self.dir_only and not is_dir:
            return False
        if self.name_only:
            return self.regex.fullmatch(path.rpartition("/")[2]) is not None
        text = ("/" if self.lead_slash else "") + path + ("/" if is_dir and self.dir_slash else "")
        if self.where == 0:
            return self.regex.fullmatch(text) is not None
        if self.where > 0:
            names = text.split("/")
            return self.regex.fullmatch("/".join(names[-self.where :])) is not None
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "/"]
        return any(self.regex.fullmatch(text, start) for start in starts)


def read_rules(folder: Path, relative: str) -> list[Rule]:
    """The rules of ``folder``'s ``.gitignore`` (none when it has none)."""
    try:
        raw = (folder / IGNORE_FILE).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return []
    rules = []
    # rsync ends a line at "\r" too: a .gitignore written on Windows reads the same.
    for line in re.split("[\r\n]", raw.decode("utf-8", errors="surrogateescape")):
        rule = Rule.parse(line, relative)
        if rule is not None:
            rules.append(rule)
    return rules


@dataclass
class Found:
    """A file a job gets: its path from the workdir, where it is on this machine (the
    target of a followed symlink), its size and whether it is executable."""

    path: str
    source: Path
    size: int
    mtime_ns: int
    inode: int
    executable: bool

    @property
    def mode(self) -> int:
        return 0o755 if self.executable else 0o644


@dataclass
class Walk:
    files: list[Found] = field(default_factory=list)
    # Symlinks left out, with why: "to a folder", "out of the workdir", "to nothing".
    skipped_links: list[tuple[str, str]] = field(default_factory=list)


def walk(root: Path) -> Walk:
    """The workdir's files as the rsync filter chooses them (see the module's text),
    sorted by path."""
    root = root.resolve()
    found = Walk()
    _walk(root, root, "", [], found)
    found.files.sort(key=lambda f: f.path)
    return found


def _walk(root: Path, folder: Path, relative: str, inherited: list[Rule], found: Walk) -> None:
    rules = inherited + read_rules(folder, relative)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (PermissionError, FileNotFoundError):
        return
    for entry in entries:
        path = f"{relative}/{entry.name}" if relative else entry.name
        if path == ".git":
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_link = entry.is_symlink()
        except OSError:
            continue
        if any(rule.matches(path, is_dir) for rule in rules):
            continue
        if is_dir:
            _walk(root, Path(entry.path), path, rules, found)
        elif is_link:
            _link(root, Path(entry.path), path, found)
        elif entry.is_file(follow_symlinks=False):
            info = entry.stat(follow_symlinks=False)
            found.files.append(_found(path, Path(entry.path), info))


def _found(path: str, source: Path, info: os.stat_result) -> Found:
    return Found(path, source, info.st_size, info.st_mtime_ns, info.st_ino,
                 bool(info.st_mode & stat.S_IXUSR))  # fmt: skip


def _link(root: Path, link: Path, path: str, found: Walk) -> None:
    """A symlink: followed to a regular file inside the workdir, else named as left out."""
    try:
        target = link.resolve(strict=True)
        info = target.stat()
    except (OSError, RuntimeError):
        found.skipped_links.append((path, "to nothing"))
        return
    if not target.is_relative_to(root):
        found.skipped_links.append((path, "out of the workdir"))
    elif stat.S_ISDIR(info.st_mode):
        found.skipped_links.append((path, "to a folder"))
    elif stat.S_ISREG(info.st_mode):
        found.files.append(_found(path, target, info))
    else:
        found.skipped_links.append((path, "to something not a file"))

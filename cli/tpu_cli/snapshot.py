"""A workdir for a job on any VM of a kind (``tpu run --type v4-8 --workdir DIR``): the
VM is known only once the job is placed, so the files go to the portal first, as a
snapshot the job names; the portal puts them at the job's folder on every worker of
whichever VM takes it.

The files are those rsync would send to a named VM (``ignore.walk``). Each is named
by its sha256, worked out once per version of the file: a cache in the client's cache
folder keys each hash by the file's path, size, modification time and inode, so a run
after editing one file reads one file. The portal says which contents it lacks
(``snapshots/missing``); only those are sent, a few uploads at a time, streamed from
disk, the small ones many to an upload; then the snapshot is made of the whole list."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tpu_cli import ignore, paths
from tpu_cli.errors import FAILED, USAGE, ApiError, CliError

CACHE_FILE = "file-hashes.json"
CACHE_VERSION = 1
UPLOADS_AT_ONCE = 4
CHUNK = 1 << 20
# Small contents go many to an upload, up to about this many bytes or files.
BUNDLE_BYTES = 8 << 20
BUNDLE_FILES = 1000

TOO_OLD = (
    "The portal at {url} takes no workdir for a job on any VM of a kind (it has no "
    "snapshots: it is older than this client). Run on a VM by name (tpu run VM --workdir "
    "…), keep the code on the VMs of the kind, or ask the portal's admins to update it."
)


class HashCache:
    """sha256 of files by (path, size, mtime_ns, inode), kept in the cache folder."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, list] = {}
        self.hashed = 0  # files read this time (for the tests: one edit, one read)
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(saved, dict) and saved.get("version") == CACHE_VERSION:
            files = saved.get("files")
            self.entries = files if isinstance(files, dict) else {}

    @classmethod
    def default(cls) -> HashCache:
        return cls(paths.cache_dir() / CACHE_FILE)

    def digest(self, found: ignore.Found) -> str:
        key = str(found.source)
        known = self.entries.get(key)
        stamp = [found.size, found.mtime_ns, found.inode]
        if isinstance(known, list) and len(known) == 4 and known[:3] == stamp:
            return str(known[3])
        digest = file_sha256(found.source)
        self.hashed += 1
        self.entries[key] = [*stamp, digest]
        return digest

    def save(self, root: Path, seen: set[str]) -> None:
        """Kept for next time: every entry of other folders, and of ``root`` the files
        seen now (a deleted or ignored file's entry goes)."""
        prefix = str(root) + os.sep
        kept = {k: v for k, v in self.entries.items() if not k.startswith(prefix) or k in seen}
        try:
            paths.private_dir(self.path.parent)
            paths.write_private(self.path, json.dumps({"version": CACHE_VERSION, "files": kept}))
        except OSError:
            pass  # a cache: the next run hashes again


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Listed:
    """The workdir as the portal is told of it."""

    root: Path
    files: list[dict]  # {"path", "size", "mode", "sha256"}
    sources: dict[str, Path]  # sha256 -> a file on this machine with that content
    skipped_links: list[tuple[str, str]]
    hashed: int
    started: float = 0.0  # time.monotonic() when the listing began

    @property
    def total(self) -> int:
        return sum(f["size"] for f in self.files)


def list_workdir(root: Path, cache: HashCache | None = None) -> Listed:
    """The workdir's files with their hashes (the cache saved again)."""
    started = time.monotonic()
    cache = cache or HashCache.default()
    walked = ignore.walk(root)
    files, sources = [], {}
    for found in walked.files:
        digest = cache.digest(found)
        files.append({"path": found.path, "size": found.size, "mode": found.mode,
                      "sha256": digest})  # fmt: skip
        sources.setdefault(digest, found.source)
    cache.save(root.resolve(), {str(f.source) for f in walked.files})
    return Listed(root, files, sources, walked.skipped_links, cache.hashed, started)


def size_text(size: int) -> str:
    """``1.3 GB``, ``512 MB``, ``12 KB``, ``7 bytes``: binary units, written as the
    portal writes them, so its refusals and the client's words give the same numbers."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{size} byte{'s' if size != 1 else ''}"


def upload(api, lab: str, root: Path, say, listed: Listed | None = None, ready=None) -> dict:
    """The workdir as a snapshot of the lab, sending only the contents the portal
    lacks; the portal's answer (``id``, ``digest``, ``files``, ``bytes``, ``expires_at``).
    ``listed``: the workdir listed already (while the portal was asked other things);
    ``ready``: called before a content is sent or the snapshot made (raising stops
    it: the job's own check, asked meanwhile)."""
    listed = listed or list_workdir(root)
    started = listed.started or time.monotonic()
    for path, why in listed.skipped_links:
        say(f"Left out {path}: a symlink {why} (only files in the workdir go with the job).")
    base = f"/labs/{lab}/snapshots"
    try:
        asked = api.post(f"{base}/missing", {"files": listed.files})
    except ApiError as exc:
        raise _refusal(exc, api, listed) from None
    missing = [m for m in dict.fromkeys(asked.get("missing") or []) if m in listed.sources]
    if ready is not None:
        ready()
    sent = _send(api, base, listed, missing)
    try:
        snapshot = api.post(base, {"files": listed.files})
    except ApiError as exc:
        again = [m for m in (exc.body.get("missing") or []) if m in listed.sources]
        if exc.status != 400 or not again:
            raise _refusal(exc, api, listed) from None
        # Contents the portal let go since it was asked (or was sent meanwhile by
        # nobody): sent once more, then the snapshot again.
        sent += _send(api, base, listed, again)
        snapshot = api.post(base, {"files": listed.files})
    took = time.monotonic() - started
    say(f"Snapshot {snapshot['id']} of {root}: {len(listed.files)} file(s), "
        f"{size_text(listed.total)}; sent {len(missing)} ({size_text(sent)}), the portal had "
        f"the rest; {took:.1f} s.")  # fmt: skip
    return snapshot


def bundles(sizes: dict[str, int]) -> tuple[list[list[str]], list[str]]:
    """The contents to send, in order: small ones grouped into uploads of about
    BUNDLE_BYTES (a request each costs the portal more than 100 kB of bytes do), and
    the large ones alone."""
    groups: list[list[str]] = []
    alone, group, group_bytes = [], [], 0
    for digest, size in sizes.items():
        if size >= BUNDLE_BYTES // 2:
            alone.append(digest)
            continue
        if group and (group_bytes + size > BUNDLE_BYTES or len(group) >= BUNDLE_FILES):
            groups.append(group)
            group, group_bytes = [], 0
        group.append(digest)
        group_bytes += size
    if group:
        groups.append(group)
    return groups, alone


def _send(api, base: str, listed: Listed, digests: list[str]) -> int:
    """Send each content the portal lacks, a few uploads at a time (small ones many to
    an upload); the bytes sent."""

    def name_of(digest: str) -> str:
        return next(f["path"] for f in listed.files if f["sha256"] == digest)

    def refused(exc: ApiError, what: str) -> CliError:
        return CliError(
            f"The portal refused {what}: {exc.detail} (if a file changed while it was sent, "
            "run again).",
            USAGE,
        )

    def one(digest: str) -> int:
        source = listed.sources[digest]
        try:
            api.put_file(f"{base}/blobs/{digest}", source)
        except OSError as exc:
            raise CliError(
                f"Could not read {name_of(digest)} to send it: {exc.strerror}.", FAILED
            ) from None
        except ApiError as exc:
            if exc.status == 400:
                raise refused(exc, name_of(digest)) from None
            raise
        return source.stat().st_size

    def many(group: list[str]) -> int:
        """One upload of the group: each content as ``<sha256> <size>`` and its bytes;
        one by one from a portal that takes a content at a time only."""
        if one_by_one.is_set():
            return sum(one(d) for d in group)
        heads = {d: f"{d} {sizes[d]}\n".encode() for d in group}
        length = sum(len(h) + sizes[d] for d, h in heads.items())

        def chunks():
            for digest in group:
                yield heads[digest]
                left = sizes[digest]
                with open(listed.sources[digest], "rb") as handle:
                    while left > 0:
                        chunk = handle.read(min(CHUNK, left))
                        if not chunk:
                            break  # shorter than it was: the portal says so
                        left -= len(chunk)
                        yield chunk

        try:
            api.post_chunks(f"{base}/blobs", chunks, length)
        except OSError as exc:
            raise CliError(f"Could not read a file to send it: {exc.strerror}.", FAILED) from None
        except ApiError as exc:
            if exc.status in (404, 405):
                one_by_one.set()
                return sum(one(d) for d in group)
            if exc.status == 400:
                raise refused(exc, f"an upload of {len(group)} file(s)") from None
            raise
        return sum(sizes[d] for d in group)

    if not digests:
        return 0
    sizes = {d: listed.sources[d].stat().st_size for d in digests}
    groups, alone = bundles(sizes)
    one_by_one = threading.Event()
    with ThreadPoolExecutor(max_workers=UPLOADS_AT_ONCE) as pool:
        sent = [pool.submit(many, group) for group in groups]
        sent += [pool.submit(one, digest) for digest in alone]
        return sum(future.result() for future in sent)


def _refusal(exc: ApiError, api, listed: Listed) -> CliError:
    """What the person reads when the portal refuses the workdir: no snapshots at all
    (an older portal), a path it takes no file at, or more than the lab allows."""
    if exc.status in (404, 405):
        return CliError(TOO_OLD.format(url=api.url), FAILED)
    if exc.status != 400:
        return exc
    lines = [f"The portal refused the workdir {listed.root}: {exc.detail}"]
    body = exc.body
    cap, cap_files = body.get("cap_bytes"), body.get("cap_files")
    person_cap = body.get("person_cap_bytes")
    numbers = any(isinstance(v, int) for v in (cap, cap_files, person_cap))
    for field_name, messages in list(exc.errors.items())[:10]:
        if numbers and field_name in ("bytes", "count"):
            continue  # the detail and the line below say it in words
        text = "; ".join(str(m) for m in messages) if isinstance(messages, list) else messages
        lines.append(f"  {field_name}: {text}")
    words = (exc.detail + " " + json.dumps(exc.errors)).lower()
    if numbers or any(w in words for w in ("cap", "too large", "total", "bytes")):
        size = f"{size_text(listed.total)} in {len(listed.files)} file(s)"
        if isinstance(cap, int):
            size += f", over the lab's cap of {size_text(cap)} on a workdir"
        elif isinstance(cap_files, int):
            size += f", over the lab's cap of {cap_files} file(s) on a workdir"
        elif isinstance(person_cap, int):
            kept = body.get("stored_bytes")
            size += (
                f"; with the {size_text(kept)} you keep stored it passes"
                if isinstance(kept, int)
                else "; it passes"
            ) + f" the {size_text(person_cap)} one person may keep"
        largest = sorted(listed.files, key=lambda f: -f["size"])[:5]
        biggest = ", ".join(f"{f['path']} ({size_text(f['size'])})" for f in largest)
        lines.append(
            f"The workdir is {size}. Largest: {biggest}. Leave out what the job does not "
            "need (data, checkpoints, outputs) in .gitignore, and keep data on a data "
            "disk or in your home on the VMs."
        )
    return CliError("\n".join(lines), USAGE)

"""The emulator's state: one JSON file that the server and the command line share.

Every change runs inside ``Store.transaction()``: an exclusive ``flock`` on a sibling
lock file, a fresh read of the JSON, the change, and an atomic replace (write a temp
file, fsync, ``os.replace``). A control command in another process therefore takes
effect on a running server at its next call, and two writers never interleave.

Readers take a shared lock and reuse the last parsed copy while the file's identity
(inode, size, mtime) is unchanged; since every write replaces the file, a new inode
always means new content. The parsed copy is never mutated in place.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

State = dict[str, Any]

SCHEMA_VERSION = 1


def empty_state() -> State:
    return {
        "version": SCHEMA_VERSION,
        # Full resource name -> node record (see controls.new_node).
        "nodes": {},
        # Full disk path (projects/p/zones/z/disks/d) -> {"size_gb": n}.
        "disks": {},
        # Full queued resource name -> request record (see queued.py).
        "queued_resources": {},
        # Zone -> accelerator type -> nodes it can hold at once (no entry: no limit).
        "capacity": {},
        # Address -> a host new nodes can be made of (see hostpool.py).
        "host_pool": {},
        # Pending injected failures, consumed in order: {"code", "method", "remaining"}.
        "faults": [],
        # Project id -> seconds every call about the project takes before it is answered
        # (a project whose API calls hang, as one lab's slow region does).
        "slow": {},
        # Project id -> settings the TPU API does not show, e.g. {"enable_oslogin": true}
        # (a real project sets enable-oslogin in its Compute Engine project metadata).
        "projects": {},
        # Counters used to hand out addresses and ids that never repeat.
        "counters": {"internal_ip": 0, "external_ip": 0, "node_id": 0},
    }


class Store:
    """Atomic, lock-protected access to the state file at ``path``."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._cache: tuple[tuple[int, int, int], State] | None = None
        self._local = threading.local()

    # -- locking ------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Each open() is its own file description, so flock also excludes other
        # threads of this process, not only other processes.
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock, mode)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- reading ------------------------------------------------------------------

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _load(self) -> State:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return empty_state()
        state = json.loads(text) if text.strip() else empty_state()
        if state.get("version") != SCHEMA_VERSION:
            raise ValueError(f"{self.path}: unknown emulator state version {state.get('version')}")
        return state

    def read(self) -> State:
        """The current state. Treat it as read-only: it may be shared with other readers."""
        current = getattr(self._local, "state", None)
        if current is not None:  # inside a transaction of this thread
            return current
        with self._locked(fcntl.LOCK_SH):
            identity = self._identity()
            cached = self._cache
            if identity is not None and cached is not None and cached[0] == identity:
                return cached[1]
            state = self._load()
            if identity is not None:
                self._cache = (identity, state)
            return state

    # -- writing ------------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self) -> Iterator[State]:
        """Yield a private copy of the state; write it back when the block succeeds.

        Nested transactions in one thread share the outer one, so a batch of controls
        (say, adding 1,200 nodes) costs one write.
        """
        current = getattr(self._local, "state", None)
        if current is not None:
            yield current
            return
        with self._locked(fcntl.LOCK_EX):
            identity = self._identity()
            cached = self._cache
            if identity is not None and cached is not None and cached[0] == identity:
                state = copy.deepcopy(cached[1])
            else:
                state = self._load()
            self._local.state = state
            try:
                yield state
            finally:
                self._local.state = None
            self._write(state)

    def _write(self, state: State) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(state, out, indent=1, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        identity = self._identity()
        if identity is not None:
            self._cache = (identity, state)

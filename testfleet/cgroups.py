"""Each fleet host's own cgroups, delegated to it the way a worker's are to the portal.

A TPU VM worker runs the portal's jobs in cgroups under ``/sys/fs/cgroup``: a cgroup v2
hierarchy, and on a hybrid machine the v1 ``pids`` and ``memory`` hierarchies beside it.
The fleet gives each host a directory of its own in each hierarchy the machine has,
under the fleet process's own cgroup (so a host stays inside whatever limits the fleet
runs under), named ``testfleet/<fleet>-<host>``. The host's processes run in it (in the
v2 hierarchy in its ``init`` leaf, so the host's root has no processes of its own, as
cgroup v2 wants of a parent whose controllers are enabled), and ``host-init.sh`` mounts
the directories where a worker has its hierarchies: on a hybrid machine a tmpfs at
``/sys/fs/cgroup`` with ``unified``, ``pids`` and ``memory`` in it; on a cgroup v2 only
machine the host's v2 directory at ``/sys/fs/cgroup``.

Nothing global is changed: no controller is moved between hierarchies and none is
enabled above the fleet's own directories.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from testfleet.system import FleetError

V1_CONTROLLERS = ("pids", "memory")
INIT_LEAF = "init"


@dataclass(frozen=True)
class Hierarchy:
    """One cgroup hierarchy of the machine: its kind (``unified`` or a v1 controller),
    where it is mounted here, and this process's own cgroup in it."""

    kind: str
    mount: str
    own: str  # e.g. "/" or "/process_api/abc"

    def dir_for(self, relative: str) -> Path:
        return Path(self.mount + relative)


def hierarchies() -> list[Hierarchy]:
    """The cgroup v2 hierarchy and the v1 pids and memory hierarchies mounted here (the
    ones a host gets), with this process's cgroup in each."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            before, _, after = line.partition(" - ")
            fstype, _, options = (after.split() + ["", "", ""])[:3]
            point = before.split()[4]
            if fstype == "cgroup2" and "unified" not in mounts:
                mounts["unified"] = point
            elif fstype == "cgroup":
                for kind in V1_CONTROLLERS:
                    if kind in options.split(",") and kind not in mounts:
                        mounts[kind] = point
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and controllers == "":
                own["unified"] = path
            for kind in controllers.split(","):
                if kind in V1_CONTROLLERS:
                    own[kind] = path
    found = []
    for kind in ("unified", *V1_CONTROLLERS):
        if kind in mounts and kind in own:
            found.append(Hierarchy(kind, mounts[kind], own[kind].rstrip("/")))
    return found


@dataclass
class HostCgroups:
    """A host's directories: ``{kind: absolute path}`` and, for host-init.sh, each as a
    path inside its hierarchy (what it mounts)."""

    dirs: dict[str, str]
    relative: dict[str, str]

    def to_json(self) -> dict:
        return {"dirs": self.dirs, "relative": self.relative}

    @classmethod
    def from_json(cls, data) -> HostCgroups | None:
        return cls(dict(data["dirs"]), dict(data["relative"])) if data else None

    @property
    def procs_files(self) -> list[str]:
        """Where the host's first process writes its pid: every process of the host
        descends from it, so all of them run in the host's cgroups."""
        files = []
        for kind, path in self.dirs.items():
            leaf = Path(path, INIT_LEAF) if kind == "unified" else Path(path)
            files.append(str(leaf / "cgroup.procs"))
        return files

    def layout(self) -> str:
        """What host-init.sh reads: ``layout hybrid|unified``, then ``<kind> <path>``."""
        kind = "hybrid" if set(self.relative) - {"unified"} else "unified"
        lines = [f"layout {kind}"] + [f"{k} {p}" for k, p in self.relative.items()]
        return "".join(f"{line}\n" for line in lines)


def host_name(fleet: str, host: str) -> str:
    return f"{fleet}-{host}"


def create(fleet: str, host: str) -> HostCgroups | None:
    """Make (or keep) the host's directories; None on a machine without cgroup v2."""
    found = hierarchies()
    if not any(h.kind == "unified" for h in found):
        return None
    dirs, relative = {}, {}
    for h in found:
        rel = f"{h.own}/testfleet/{host_name(fleet, host)}"
        path = h.dir_for(rel)
        path.mkdir(parents=True, exist_ok=True)
        if h.kind == "unified":
            (path / INIT_LEAF).mkdir(exist_ok=True)
        dirs[h.kind], relative[h.kind] = str(path), rel
    return HostCgroups(dirs, relative)


def leftovers(fleet: str) -> list[str]:
    """Host directories of this fleet under this process's cgroups (from a run whose
    state file is gone)."""
    found = []
    for h in hierarchies():
        base = h.dir_for(f"{h.own}/testfleet")
        if base.is_dir():
            found += sorted(str(p) for p in base.glob(f"{fleet}-h*") if p.is_dir())
    return found


def remove(paths, timeout: float = 10) -> None:
    """Kill whatever still runs in each directory and remove it with everything below
    (the host's job cgroups too), deepest first."""
    deadline = time.monotonic() + timeout
    for top in paths:
        top = Path(top)
        if not top.is_dir():
            continue
        below = sorted(
            (p for p in top.rglob("*") if p.is_dir() and (p / "cgroup.procs").exists()),
            key=lambda p: len(p.parts),
            reverse=True,
        )
        for path in [*below, top]:
            _empty(path, deadline)
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise FleetError(f"cannot remove the cgroup {path}: {exc}") from exc
        _prune(top.parent)


def _empty(path: Path, deadline: float) -> None:
    kill_file = path / "cgroup.kill"
    while True:
        pids = _procs(path)
        if not pids:
            return
        if kill_file.exists():
            kill_file.write_text("1")
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise FleetError(f"processes stay in the cgroup {path}: {pids}")
        time.sleep(0.02)


def _procs(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _prune(base: Path) -> None:
    """Remove the fleet's ``testfleet`` directory once no fleet uses it."""
    if base.name == "testfleet":
        try:
            base.rmdir()
        except OSError:
            pass

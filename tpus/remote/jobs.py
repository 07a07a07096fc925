"""The stdin and stdout of the job scripts (``scripts/job-*.sh``): one encoder per
script, checking every field again with strict patterns before anything is sent (the
scripts check once more on the host), and one parser per answer. No Django here.

Formats (one record per line, see docs/jobs-host.md); free text (paths, arguments,
environment values) travels as base64, so no byte of it is ever read by a shell::

    tpu-portal-job-preflight 1            tpu-portal-job-start 1
    user <name>                           job <id>
    chips <count> <device glob>           user <name>
    min_disk_mb <n>                       python <b64 venv>     (optional)
    min_mem_mb <n>                        cwd <b64 dir>         (optional)
    port <n>            (worker 0)        pod <host:port> <processes> <process id>
    python <b64 venv>   (optional)        env <NAME> <b64 value>
    script <b64 path>   (optional)        arg <b64>             (one at least)
    env <NAME>                            tasks_max <n>         memory_max_mb <n>
    probe_seconds <n>   (optional)        log_max_bytes <n>     keep_days <n>
    end                                   metrics_ports <n>[,<n>…]  (optional)
                                          hold      (optional: then the word)
                                          end

    the word to a held start:  go / env <NAME> <b64 value> (repeated) / end

    tpu-portal-job-status 1               tpu-portal-job-cancel 1
    max_bytes <n>                         job <id>
    offset <job id> <bytes>               grace <seconds>
    chips <device glob>  (optional)       end
    metrics <port>[,<port>…]  (optional)
    end

    tpu-portal-holder-stop 1   (a process outside the portal holding a chip)
    pid <pid>
    start <ticks>
    chips <device glob>
    grace <seconds>
    end
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from tpus.remote.desired import check_username

# Names a job may not set: they would break the one-process-per-TPU rule, fake the
# topology, or override what the portal sets itself. job-preflight.sh and job-start.sh
# hold the same list.
FORBIDDEN_ENV = frozenset({
    "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES", "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
    "TPU_PROCESS_PORT", "TPU_HOST_BOUNDS", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
    "TPU_ACCELERATOR_TYPE", "TPU_SKIP_MDS_QUERY", "TPU_MESH_CONTROLLER_ADDRESS",
    "TPU_MESH_CONTROLLER_PORT", "CLOUD_TPU_TASK_ID", "ALLOW_MULTIPLE_LIBTPU_LOAD",
    "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "LD_LIBRARY_PATH", "HOME", "USER",
    "LOGNAME", "PATH", "VIRTUAL_ENV", "TPU_RUNTIME_METRICS_PORTS",
})  # fmt: skip
FORBIDDEN_ENV_PREFIX = "TPU_PORTAL_"

_JOB_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_GLOB = re.compile(r"/dev/[A-Za-z0-9/_.*?-]{1,100}")
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}")
MAX_TEXT = 4096
MAX_ARGS = 256
MAX_ENV = 128
MAX_LOG_BYTES = 1024 * 1024
MAX_GRACE = 600
MAX_TASKS = 4194304  # the kernel's own ceiling on pids
MIN_TASKS = 16
MIN_MEMORY_MB = 32
MIN_LOG_CAP = 1024
MAX_PROBE_SECONDS = 600
# libtpu's runtime metrics (tpu-info's gRPC service): the ports a job's libtpu serves
# them on (TPU_RUNTIME_METRICS_PORTS, one per process on the worker), and the most
# chips one worker may report.
MAX_METRICS_PORTS = 8
MAX_METRIC_CHIPS = 64
MAX_HBM_BYTES = 2**50  # 1 PiB: far above any chip's HBM


@dataclass(frozen=True)
class Preflight:
    """What job-preflight.sh checks on one worker."""

    user: str
    chips: int
    device_glob: str
    min_disk_mb: int
    min_mem_mb: int
    coordinator_port: int | None = None  # worker 0 only
    python: str = ""  # a venv; empty: the system's python3
    script: str = ""  # the job's script, which must lie in the home
    env_names: tuple[str, ...] = ()
    # The longest one probe run as the user (the environment's python, realpath,
    # sha256sum) may take before it is killed and its check fails.
    probe_seconds: int = 20
    # A workdir snapshot's contents, (sha256, size) each once: the answer names those
    # the person's cache on the worker lacks (``snapshot_missing``).
    snapshot_blobs: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Pod:
    """What ``jax.distributed.initialize`` needs, as TPU_PORTAL_* variables."""

    coordinator: str  # "host:port" of worker 0
    num_processes: int
    process_id: int


@dataclass(frozen=True)
class StartJob:
    """What job-start.sh runs on one worker."""

    job_id: str
    user: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    python: str = ""
    cwd: str = ""
    pod: Pod | None = None
    # The job's cgroup on the worker: at most this many tasks (processes and threads)
    # and this much memory (0: 90% of the worker's); the log keeps this many bytes.
    tasks_max: int = 4096
    memory_max_mb: int = 0
    log_max_bytes: int = 100 * 1024 * 1024
    # The worker removes the folders of jobs that ended longer ago (0: never).
    keep_days: int = 0
    # Where the job's libtpu serves its runtime metrics (TPU_RUNTIME_METRICS_PORTS).
    metrics_ports: tuple[int, ...] = ()
    # Prepare the cgroup and the folder at once, then wait on stdin for the word
    # (``encode_word``): sent with the pre-flight, in the same exec.
    hold: bool = False


def encode_preflight(spec: Preflight) -> bytes:
    lines = ["tpu-portal-job-preflight 1", f"user {check_username(spec.user)}"]
    lines.append(f"chips {_int(spec.chips, 'chips', 0, 999)} {check_device_glob(spec.device_glob)}")
    lines.append(f"min_disk_mb {_int(spec.min_disk_mb, 'min_disk_mb', 0, 10**9 - 1)}")
    lines.append(f"min_mem_mb {_int(spec.min_mem_mb, 'min_mem_mb', 0, 10**9 - 1)}")
    if spec.coordinator_port is not None:
        lines.append(f"port {_int(spec.coordinator_port, 'port', 1, 65535)}")
    if spec.python:
        lines.append(f"python {_b64(check_path(spec.python, 'python'))}")
    if spec.script:
        lines.append(f"script {_b64(check_path(spec.script, 'script'))}")
    names = _sequence(spec.env_names, "env_names")
    if len(names) > MAX_ENV or len(set(names)) != len(names):
        raise ValueError(f"at most {MAX_ENV} distinct environment names")
    lines += [f"env {check_env_name(name)}" for name in names]
    lines.append(f"probe_seconds {_int(spec.probe_seconds, 'probe_seconds', 1, MAX_PROBE_SECONDS)}")
    if not spec.snapshot_blobs:
        return _finish(lines)
    listing = _blob_lines(spec.snapshot_blobs)
    lines.append(f"snapshot {len(spec.snapshot_blobs)} {len(listing)}")
    return _finish(lines) + listing


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_SNAPSHOT_FILES = 100_000
MAX_BLOB_BYTES = 2**40


def _blob_lines(blobs: Sequence[tuple[str, int]]) -> bytes:
    if len(blobs) > MAX_SNAPSHOT_FILES or len({sha for sha, _ in blobs}) != len(blobs):
        raise ValueError(f"a snapshot names at most {MAX_SNAPSHOT_FILES} distinct contents")
    return "".join(
        f"{check_sha256(sha)} {_int(size, 'size', 0, MAX_BLOB_BYTES)}\n" for sha, size in blobs
    ).encode()


def check_sha256(value: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ValueError("a content's sha256 is 64 lowercase hex digits")
    return value


@dataclass(frozen=True)
class Place:
    """What snapshot-place.sh puts on one worker: the files of a workdir snapshot at
    ``directory`` (in the person's home), from the person's cache there, after storing
    in that cache the contents it lacks (``blobs``: (sha256, size), sent after the
    header in that order, each as ``<sha256> <size>`` and the bytes)."""

    user: str
    directory: str
    files: tuple[tuple[str, int, str], ...]  # (relative path, mode, sha256)
    blobs: tuple[tuple[str, int], ...] = ()


def encode_place(place: Place) -> bytes:
    """The header of snapshot-place.sh's input (the contents follow it)::

    tpu-portal-snapshot-place 1
    user <name>
    dir <b64 absolute folder>
    files <count> <bytes>      (the file list after end: <sha256> <644|755> <b64 path>)
    blobs <count> <bytes>      (the contents after the list, as said above)
    end
    """
    listing = []
    for path, mode, sha in place.files:
        if mode not in (0o644, 0o755):
            raise ValueError("a file's mode is 0644 or 0755")
        check_relative(path)
        listing.append(f"{check_sha256(sha)} {mode:o} {_b64(path)}\n")
    body = "".join(listing).encode()
    sent = sum(
        len(f"{check_sha256(sha)} {_int(size, 'size', 0, MAX_BLOB_BYTES)}\n") + size
        for sha, size in place.blobs
    )
    lines = ["tpu-portal-snapshot-place 1", f"user {check_username(place.user)}"]
    lines.append(f"dir {_b64(check_path(place.directory, 'the folder'))}")
    if not place.files or len(place.files) > MAX_SNAPSHOT_FILES:
        raise ValueError(f"a snapshot has 1 to {MAX_SNAPSHOT_FILES} files")
    lines.append(f"files {len(place.files)} {len(body)}")
    lines.append(f"blobs {len(place.blobs)} {sent}")
    return _finish(lines) + body


def check_relative(path: str) -> str:
    """A snapshot's path: relative, plain parts, no control character."""
    if (
        not isinstance(path, str)
        or not path
        or path.startswith("/")
        or any(part in ("", ".", "..") for part in path.split("/"))
        or any(ord(c) < 32 or ord(c) == 127 for c in path)
        or len(path.encode()) > 1024
    ):
        raise ValueError("a snapshot's path is relative, with plain parts")
    return path


def parse_missing(values: Iterable[str]) -> set[str]:
    """The ``snapshot_missing`` values of a pre-flight's answer."""
    return {check_sha256(v.strip()) for v in values}


def encode_start(job: StartJob) -> bytes:
    lines = ["tpu-portal-job-start 1", f"job {check_job_id(job.job_id)}"]
    lines.append(f"user {check_username(job.user)}")
    if job.python:
        lines.append(f"python {_b64(check_path(job.python, 'python'))}")
    if job.cwd:
        lines.append(f"cwd {_b64(check_path(job.cwd, 'cwd'))}")
    if job.pod is not None:
        pod = job.pod
        host, _, port = str(pod.coordinator).rpartition(":")
        if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("the coordinator is host:port")
        count = _int(pod.num_processes, "num_processes", 1, 9999)
        lines.append(
            f"pod {host}:{int(port)} {count} {_int(pod.process_id, 'process_id', 0, count - 1)}"
        )
    env = _sequence(job.env, "env")
    if len(env) > MAX_ENV or len({name for name, _ in env}) != len(env):
        raise ValueError(f"at most {MAX_ENV} distinct environment variables")
    for name, value in env:
        lines.append(f"env {check_env_name(name)} {_b64(_text(value, f'the value of {name}'))}")
    argv = _sequence(job.argv, "argv")
    if not argv or len(argv) > MAX_ARGS:
        raise ValueError(f"the command is 1 to {MAX_ARGS} arguments")
    if not argv[0] or "=" in argv[0]:
        raise ValueError("the command's first word is not empty and has no '='")
    lines += [f"arg {_b64(_text(arg, 'an argument'))}" for arg in argv]
    lines.append(f"tasks_max {_int(job.tasks_max, 'tasks_max', MIN_TASKS, MAX_TASKS)}")
    memory = _int(job.memory_max_mb, "memory_max_mb", 0, 10**9 - 1)
    if 0 < memory < MIN_MEMORY_MB:
        raise ValueError(f"memory_max_mb is 0 (90% of the worker's) or at least {MIN_MEMORY_MB}")
    lines.append(f"memory_max_mb {memory}")
    lines.append(
        f"log_max_bytes {_int(job.log_max_bytes, 'log_max_bytes', MIN_LOG_CAP, 10**15 - 1)}"
    )
    lines.append(f"keep_days {_int(job.keep_days, 'keep_days', 0, 99999)}")
    if job.metrics_ports:
        lines.append(f"metrics_ports {check_metrics_ports(job.metrics_ports)}")
    if job.hold:
        lines.append("hold")
    return _finish(lines)


def encode_word(env: Sequence[tuple[str, str]] = ()) -> bytes:
    """What follows ``go`` to a held start (``StartJob.hold``): variables to add to the
    job's environment (found by the pre-flight, such as TCMalloc), then ``end``."""
    env = _sequence(env, "env")
    if len(env) > MAX_ENV:
        raise ValueError(f"at most {MAX_ENV} environment variables")
    lines = [f"env {check_env_name(n)} {_b64(_text(v, f'the value of {n}'))}" for n, v in env]
    return ("\n".join([*lines, "end"]) + "\n").encode("ascii")


def encode_status(
    offsets: Mapping[str, int],
    max_bytes: int = 65536,
    device_glob: str = "",
    *,
    tail: bool = False,
    metrics_ports: Sequence[int] = (),
) -> bytes:
    """``device_glob``: also name every process holding a chip. ``tail``: when more
    than ``max_bytes`` are new, answer the log's last ``max_bytes`` (for a page)
    instead of the next ones (for a download). ``metrics_ports``: also read libtpu's
    runtime metrics on these local ports (HBM and duty cycle per chip)."""
    lines = [
        "tpu-portal-job-status 1",
        f"max_bytes {_int(max_bytes, 'max_bytes', 0, MAX_LOG_BYTES)}",
    ]
    word = "tail" if tail else "offset"
    for job_id, offset in offsets.items():
        lines.append(f"{word} {check_job_id(job_id)} {_int(offset, 'offset', 0, 10**15 - 1)}")
    if device_glob:
        lines.append(f"chips {check_device_glob(device_glob)}")
    if metrics_ports:
        lines.append(f"metrics {check_metrics_ports(metrics_ports)}")
    return _finish(lines)


def encode_cancel(job_id: str, grace: int) -> bytes:
    lines = ["tpu-portal-job-cancel 1", f"job {check_job_id(job_id)}"]
    lines.append(f"grace {_int(grace, 'grace', 0, MAX_GRACE)}")
    return _finish(lines)


def encode_holder_stop(pid: int, start: int, device_glob: str, grace: int) -> bytes:
    """holder-stop.sh's input: the process (pid and start time) and the TPU's chips."""
    lines = [
        "tpu-portal-holder-stop 1",
        f"pid {_int(pid, 'pid', 1, 9_999_999_999)}",
        f"start {_int(start, 'start', 0, 10**20 - 1)}",
        f"chips {check_device_glob(device_glob)}",
        f"grace {_int(grace, 'grace', 0, MAX_GRACE)}",
    ]
    return _finish(lines)


# --- answers -------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One line of job-preflight.sh: ``check=<name> ok|fail|note <detail>``."""

    name: str
    status: str
    detail: str


@dataclass
class PreflightReport:
    checks: list[Check]

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def detail(self, name: str) -> str:
        return next((c.detail for c in self.checks if c.name == name), "")

    @property
    def script_sha256(self) -> str:
        match = re.match(r"sha256=([0-9a-f]{64}) ", self.detail("script"))
        return match[1] if match else ""

    @property
    def versions(self) -> dict[str, str]:
        """``python``, ``jax``, ``jaxlib``, ``libtpu``, ``requests``, ``libtpu_pin``."""
        return dict(p.split("=", 1) for p in self.detail("python").split() if "=" in p)


_CHECK = re.compile(r"([a-z_]+) (ok|fail|note) ?(.*)")


def parse_preflight(values: Iterable[str]) -> PreflightReport:
    """The ``check`` values of an answer (``ScriptResult.all("check")``)."""
    checks = []
    for value in values:
        match = _CHECK.fullmatch(value)
        if not match:
            raise ValueError(f"not a check line: {value[:100]!r}")
        checks.append(Check(match[1], match[2], match[3].strip()))
    return PreflightReport(checks)


def differing_scripts(reports: Mapping[str, PreflightReport]) -> list[str]:
    """The workers whose script differs from worker 0's (the first given); a worker
    whose check found no script counts as differing."""
    if not reports:
        return []
    names = list(reports)
    first = reports[names[0]].script_sha256
    return [n for n in names[1:] if not first or reports[n].script_sha256 != first]


def judge_versions(versions: Mapping[str, str], *, need_libtpu: bool) -> list[str]:
    """Problems with a Python environment's versions: jax and jaxlib the same release,
    and on a TPU libtpu within jax's own pin and ``requests`` present."""
    problems = []
    try:
        jax, jaxlib = Version(versions.get("jax", "")), Version(versions.get("jaxlib", ""))
    except InvalidVersion:
        return ["jax or jaxlib is missing"]
    if jaxlib.release[:2] != jax.release[:2] or jaxlib > jax:
        problems.append(f"jaxlib {jaxlib} does not fit jax {jax}")
    if need_libtpu:
        pin = versions.get("libtpu_pin", "none")
        libtpu = versions.get("libtpu", "none")
        if libtpu == "none":
            problems.append("libtpu is not installed (pip install 'jax[tpu]')")
        elif pin != "none":
            try:
                spec = SpecifierSet(pin.removeprefix("libtpu"))
                if Version(libtpu) not in spec:
                    problems.append(f"libtpu {libtpu} does not fit jax's pin {pin}")
            except (InvalidSpecifier, InvalidVersion):
                problems.append(f"cannot judge libtpu {libtpu} against {pin}")
        if versions.get("requests", "none") == "none":
            problems.append("requests is not installed (jax reads the TPU's metadata with it)")
    return problems


@dataclass(frozen=True)
class StartAnswer:
    outcome: str  # started | running | refused
    reason: str = ""  # for refused: "busy <job>" or "ended"
    pid: int | None = None
    boot_id: str = ""
    started_at: float | None = None
    cgroup: str = ""  # the job's cgroup (a path, or a systemd scope's)
    tasks_max: int | None = None  # None: the worker offers no way to limit it
    memory_max: int | None = None  # bytes


def parse_start(values: Mapping[str, str]) -> StartAnswer:
    outcome, _, reason = values.get("start", "").partition(" ")
    if outcome not in ("started", "running", "refused"):
        raise ValueError(f"job-start.sh gave no outcome: {values.get('start')!r}")
    if outcome != "started":
        return StartAnswer(outcome, reason)
    return StartAnswer(
        outcome,
        pid=int(values["pid"]),
        boot_id=values["boot_id"],
        started_at=float(values["started_at"]),
        cgroup="" if values.get("cgroup", "-") == "-" else values["cgroup"],
        tasks_max=_limit(values.get("tasks_max")),
        memory_max=_limit(values.get("memory_max")),
    )


def _limit(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


@dataclass
class JobState:
    """One job on one worker, as job-status.sh saw it."""

    job_id: str
    state: str  # running | ended | lost | unknown
    pid: int | None = None
    boot_id: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    exit_status: int | None = None
    signal: str = ""
    cancel_requested: bool = False
    process_alive: bool = False
    log_size: int = 0
    log_offset: int = 0
    log: bytes = b""

    @property
    def succeeded(self) -> bool:
        return self.state == "ended" and self.exit_status == 0


@dataclass(frozen=True)
class ChipHolder:
    """A process with a chip open: ``job`` (the portal job whose cgroup it runs in) or
    ``pgid`` tells the portal's own jobs' from others."""

    device: str
    pid: int
    pgid: int | None
    user: str
    command: str
    job: str = ""
    start: int | None = None  # its start time (clock ticks after boot): who it is


@dataclass(frozen=True)
class ChipMetrics:
    """One chip's runtime metrics as its libtpu served them on the worker."""

    chip: int  # libtpu's device id on the worker
    hbm_used: int  # bytes
    hbm_total: int  # bytes
    duty: float  # TensorCore duty cycle, percent


@dataclass
class WorkerMetrics:
    """The answer to ``metrics``: the chips read, or why there are none (nothing
    listens on the ports, the worker has no python3, no answer in time)."""

    chips: list[ChipMetrics] = field(default_factory=list)
    none: str = ""  # the reason there are no metrics; "" when some were read


@dataclass
class StatusReport:
    boot_id: str
    lock_holder: str | None  # the job holding the TPU's lock, or None when free
    jobs: dict[str, JobState] = field(default_factory=dict)
    holders: list[ChipHolder] = field(default_factory=list)
    metrics: WorkerMetrics | None = None  # None: not asked for
    metrics_error: str = ""  # why the metrics lines were refused, if they were


_STATES = ("running", "ended", "lost", "unknown")


def parse_status(pairs: Sequence[tuple[str, str]]) -> StatusReport:
    """The ``(key, value)`` pairs of job-status.sh (``ScriptResult.pairs``)."""
    values = dict(pairs)
    lock = values.get("lock", "")
    if lock != "free" and not lock.startswith("held "):
        raise ValueError(f"job-status.sh gave no lock state: {lock!r}")
    report = StatusReport(values.get("boot_id", ""), None if lock == "free" else lock[5:])
    metric_lines: list[tuple[str, str]] = []
    for key, value in pairs:
        if key == "job":
            report.jobs[_job_id_of(value)] = _job_state(value)
        elif key == "log":
            job_id, offset, data = (value.split(" ", 2) + [""])[:3]
            job = report.jobs.get(job_id)
            if job is None:
                raise ValueError(f"log bytes for a job not reported: {job_id!r}")
            job.log_offset, job.log = int(offset), base64.b64decode(data, validate=True)
        elif key == "holder":
            report.holders.append(_holder(value))
        elif key in ("metrics", "chip"):
            metric_lines.append((key, value))
    if metric_lines:
        # Metrics that do not read are none at all, and the rest of the answer stands.
        try:
            report.metrics = parse_metrics(metric_lines)
        except ValueError as exc:
            report.metrics = WorkerMetrics(none="unreadable")
            report.metrics_error = str(exc)
    return report


_METRICS_NONE = re.compile(r"none ([a-z0-9 ,.:()-]{1,200})")
_CHIP = re.compile(
    r"([0-9]{1,3}) used=([0-9]{1,16}) total=([0-9]{1,16}) duty=([0-9]{1,3}(?:\.[0-9]{1,2})?)"
)


def parse_metrics(lines: Sequence[tuple[str, str]]) -> WorkerMetrics:
    """The ``metrics`` and ``chip`` lines of job-status.sh: ``metrics=ok`` then at most
    MAX_METRIC_CHIPS ``chip=<id> used=<bytes> total=<bytes> duty=<percent>``, each chip
    once, or ``metrics=none <reason>`` alone. Anything else is refused whole."""
    if not lines or lines[0][0] != "metrics":
        raise ValueError("chip metrics without the metrics line first")
    first = lines[0][1]
    match = _METRICS_NONE.fullmatch(first)
    if match:
        if len(lines) > 1:
            raise ValueError("more metrics after the worker said it has none")
        return WorkerMetrics(none=match[1])
    if first != "ok":
        raise ValueError(f"not a metrics line: {first[:100]!r}")
    if len(lines) - 1 > MAX_METRIC_CHIPS:
        raise ValueError(f"more than {MAX_METRIC_CHIPS} chips")
    report = WorkerMetrics()
    for key, value in lines[1:]:
        match = _CHIP.fullmatch(value) if key == "chip" else None
        if not match:
            raise ValueError(f"not a chip metrics line: {key}={value[:100]!r}")
        chip, used, total, duty = int(match[1]), int(match[2]), int(match[3]), float(match[4])
        if chip >= MAX_METRIC_CHIPS or total > MAX_HBM_BYTES or used > total or duty > 100:
            raise ValueError(f"chip metrics out of bounds: {value[:100]!r}")
        if any(c.chip == chip for c in report.chips):
            raise ValueError(f"chip {chip} is reported twice")
        report.chips.append(ChipMetrics(chip, used, total, duty))
    if not report.chips:
        raise ValueError("metrics=ok without a chip")
    return report


_HOLDER = re.compile(
    r"(/dev/\S+) pid=([0-9]+) pgid=([0-9]+|\?)(?: start=([0-9]+|\?))? user=(\S+)"
    r"(?: job=([a-z0-9-]+))? command=(.*)"
)


def _holder(value: str) -> ChipHolder:
    match = _HOLDER.fullmatch(value)
    if not match:
        raise ValueError(f"not a holder line: {value[:100]!r}")
    pgid = None if match[3] == "?" else int(match[3])
    start = None if match[4] in (None, "?") else int(match[4])
    job = "" if match[6] in (None, "-") else match[6]
    return ChipHolder(match[1], int(match[2]), pgid, match[5], match[7].strip(), job, start)


def _job_id_of(value: str) -> str:
    return check_job_id(value.split(" ", 1)[0])


def _job_state(value: str) -> JobState:
    parts = value.split(" ")
    job = JobState(parts[0], parts[1] if len(parts) > 1 else "")
    if job.state not in _STATES:
        raise ValueError(f"unknown job state {job.state!r}")
    fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)

    def number(key, kind):
        text = fields.get(key, "-")
        return None if text in ("-", "") else kind(text)

    job.pid = number("pid", int)
    job.boot_id = fields.get("boot_id", "")
    job.started_at = number("started_at", float)
    job.ended_at = number("ended_at", float)
    job.exit_status = number("exit", int)
    job.signal = "" if fields.get("signal", "-") == "-" else fields["signal"]
    job.cancel_requested = fields.get("cancel") == "1"
    job.process_alive = fields.get("process") == "alive"
    job.log_size = number("log_size", int) or 0
    return job


def parse_cancel(values: Mapping[str, str]) -> tuple[str, bool]:
    """How the job ended (``term``, ``kill``, ``ended``; ``lost``: it went with an
    earlier boot and nothing was signalled; ``unknown``) and whether the TPU's lock is
    free now. ``cancel_emptied`` says whether anything of the job still runs."""
    how = values.get("cancel", "")
    if how not in ("term", "kill", "ended", "lost", "unknown"):
        raise ValueError(f"job-cancel.sh gave no outcome: {how!r}")
    return how, values.get("lock") == "free"


HOLDER_STOPS = ("term", "kill", "gone", "other", "released")


def parse_holder_stop(values: Mapping[str, str]) -> tuple[str, bool]:
    """How holder-stop.sh ended the process (``term``, ``kill``; ``gone``, ``other``,
    ``released``: nothing was signalled) and whether it still runs."""
    how = values.get("stop", "")
    if how not in HOLDER_STOPS:
        raise ValueError(f"holder-stop.sh gave no outcome: {how!r}")
    return how, values.get("alive") == "1"


def cancel_emptied(values: Mapping[str, str]) -> bool:
    """Whether job-cancel.sh left nothing of the job running (its cgroup is empty)."""
    return values.get("empty", "1") == "1"


# --- field checks --------------------------------------------------------------------


def check_job_id(value: object) -> str:
    if not isinstance(value, str) or not _JOB_ID.fullmatch(value):
        raise ValueError("a job id is 1-64 of a-z, 0-9 and '-', starting with a letter or digit")
    return value


def check_env_name(value: object) -> str:
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise ValueError(
            "an environment name is letters, digits and '_', not starting with a digit"
        )
    if value in FORBIDDEN_ENV or value.startswith(FORBIDDEN_ENV_PREFIX):
        raise ValueError(f"{value} is set by the portal or breaks one process per TPU")
    return value


def check_device_glob(value: object) -> str:
    if not isinstance(value, str) or not _GLOB.fullmatch(value) or ".." in value:
        raise ValueError("a device glob is a pattern under /dev such as /dev/accel*")
    return value


def check_metrics_ports(value: object) -> str:
    """The ports as the scripts take them: ``8431,8432``."""
    ports = _sequence(value, "metrics_ports")
    if not 1 <= len(ports) <= MAX_METRICS_PORTS or len(set(ports)) != len(ports):
        raise ValueError(f"metrics_ports are 1 to {MAX_METRICS_PORTS} distinct ports")
    return ",".join(str(_int(p, "a metrics port", 1024, 65535)) for p in ports)


def check_path(value: object, what: str) -> str:
    text = _text(value, what)
    if not text.startswith("/"):
        raise ValueError(f"{what} must be an absolute path")
    return text


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value.encode()) > MAX_TEXT:
        raise ValueError(f"{what} must be text of at most {MAX_TEXT} bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} must not contain control characters")
    return value


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _int(value: object, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high}")
    return value


def _sequence(value: object, what: str) -> tuple:
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
        raise ValueError(f"{what} must be a tuple")
    return tuple(value)


def _finish(lines: list[str]) -> bytes:
    return ("\n".join([*lines, "end"]) + "\n").encode("ascii")

"""Following a job: its states from the portal, and every worker's log live through
the person's own ssh (``tail -F`` of the job's log on each worker, as docs/jobs-host.md
says), merged with a ``(w3)`` prefix, cleaned of terminal escape sequences (``terminal``).
Ctrl-C detaches; the job goes on."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from tpu_cli import remote
from tpu_cli.errors import FAILED, CliError
from tpu_cli.terminal import clean_line, clean_lines

ENDED = ("succeeded", "failed", "cancelled", "lost", "rejected")
WAITING = ("queued", "blocked")
_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")

# Waits for the job's supervisor and log (a job that starts a moment later), then
# prints the log from its first byte and follows it until the supervisor has ended; a
# job that has ended already (its `exit` is there) is printed whole.
_TAIL = (
    "d=/var/lib/tpu-portal/jobs/{id}; i=0; "
    'while {{ [ ! -s "$d/supervisor" ] || [ ! -e "$d/log" ]; }} && [ ! -e "$d/exit" ] '
    "&& [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done; "
    '[ -e "$d/log" ] || exit 3; '
    '[ ! -e "$d/exit" ] || exec cat "$d/log"; '
    'read -r sup _ < "$d/supervisor" || exit 3; '
    'exec tail -c +1 -s 0.2 -F --pid="$sup" "$d/log" 2>/dev/null'
)


def tail_command(host_id: str) -> str:
    if not _HOST_ID.match(host_id or ""):
        raise CliError(f"The portal gave a job id this client cannot use: {host_id!r}.")
    return _TAIL.format(id=host_id)


def job_exit_code(job: dict) -> int:
    """The job's own exit code as the portal gives it (0 when it succeeded, else that of
    the worker whose process failed first; 128 + N for signal N); 1 for an ended job
    without one (rejected, cancelled before it started)."""
    code = job.get("exit_code")
    return FAILED if code is None else int(code)


def why(job: dict) -> list[str]:
    """What the person should read when a job did not succeed: its reason, the
    pre-flight checks that failed, and each worker's error (what a worker said, cleaned
    of escape sequences as its log is)."""
    return [clean_line(line) for line in _why(job)]


def _why(job: dict) -> list[str]:
    lines = []
    if job.get("reason"):
        lines.append(job["reason"])
    for check in job.get("preflight", []):
        if check["status"] == "fail":
            lines.append(f"  pre-flight w{check['worker']} {check['check']}: {check['detail']}")
    for part in job.get("parts", []):
        bits = []
        if part.get("exit_status") not in (None, 0):
            bits.append(f"exit {part['exit_status']}")
        if part.get("signal"):
            bits.append(f"signal {part['signal']}")
        if part.get("error"):
            bits.append(part["error"])
        if bits:
            lines.append(f"  w{part['index']}: {', '.join(bits)}")
    return lines


def _started(job: dict) -> bool:
    """Whether the job's command began on its workers (a rejected one never does, nor
    one cancelled while its pre-flight ran, which shows ``cancelling`` until it ends)."""
    if job["state"] in ("starting", "running"):
        return True
    return any(part.get("started_at") for part in job.get("parts", []))


# Seconds a started job's ssh tail may show nothing while the portal sees its log grow.
SSH_QUIET = 10.0


class Tailer:
    """One worker's log, followed over ssh."""

    def __init__(self, ssh: list[str], host: str, host_id: str, label: str):
        self.label = label
        self.printed = False
        self.proc = remote.start([*ssh, *remote.BATCH, host, tail_command(host_id)])
        self.errors: list[bytes] = []
        self.threads = [
            threading.Thread(target=self._copy, daemon=True),
            threading.Thread(target=lambda: self.errors.append(self.proc.stderr.read()),
                             daemon=True),
        ]  # fmt: skip
        for thread in self.threads:
            thread.start()

    def _copy(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.printed = True
            line = clean_line(raw.decode("utf-8", errors="replace").rstrip("\n"))
            with remote._print_lock:
                sys.stdout.write(f"{self.label}{line}\n")
                sys.stdout.flush()

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return False
        for thread in self.threads:
            thread.join(timeout=2)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Follow:
    """Follow job ``job_id`` of ``vm`` to its end; ``say`` prints a status line."""

    def __init__(self, api, vm, job_id: int, ssh: list[str], say, *, worker: int | None = None,
                 logs: bool = True):  # fmt: skip
        self.api, self.vm, self.job_id, self.ssh, self.say = api, vm, job_id, ssh, say
        self.worker = worker
        self.logs = logs
        self.path = f"{vm.api_path}/jobs/{job_id}"
        self.tailers: dict[int, Tailer] = {}
        self.tails_began = 0.0
        # Workers followed from the portal: the log bytes already printed.
        self.from_portal: dict[int, int] = {}

    def run(self) -> dict:
        """The job as it ended. Ctrl-C (KeyboardInterrupt) stops the tails and goes up."""
        last = None
        try:
            while True:
                job = self.api.get(self.path)
                state = job["state"]
                seen = (state, job.get("position"), job.get("reason") if state in WAITING else "")
                if seen != last:
                    self.say(self._status(job))
                    last = seen
                if self.logs and not self.tailers and _started(job):
                    self._start_tails(job)
                self._from_the_portal(job)
                if state in ENDED:
                    break
                time.sleep(0.5 if state in ("validating", "starting") else 1.0)
            self._finish(job)
            return job
        finally:
            for tailer in self.tailers.values():
                tailer.stop()

    def _status(self, job: dict) -> str:
        state = job["state"]
        text = f"Job {job['id']} on {self.vm.label}: {state}"
        if job.get("position"):
            text += f" (place {job['position']} in the queue)"
        if state in WAITING and job.get("reason"):
            text += f" — {job['reason']}"
        return text

    def _indexes(self, job: dict) -> list[int]:
        parts = sorted({p["index"] for p in job.get("parts", [])}) or list(self.vm.hosts())
        if self.worker is not None:
            if self.worker not in parts:
                raise CliError(f"Job {job['id']} has no part on worker {self.worker}.", 2)
            return [self.worker]
        return parts

    def _start_tails(self, job: dict) -> None:
        hosts = self.vm.hosts()
        indexes = [i for i in self._indexes(job) if i in hosts]
        show = len(indexes) > 1
        self.tails_began = time.monotonic()
        for index in indexes:
            label = remote.label_for(index, show)
            self.tailers[index] = Tailer(self.ssh, hosts[index], job["host_id"], label)

    def _from_the_portal(self, job: dict) -> None:
        """A worker whose log the portal has seen grow while ssh showed nothing of it
        for ``SSH_QUIET`` seconds (ssh cannot reach it from here, or cannot read the
        log) is followed from the portal instead: the new end of its log at each poll,
        so the output never goes quiet while the job runs."""
        if not self.tailers or time.monotonic() - self.tails_began < SSH_QUIET:
            return
        show = len(self.tailers) > 1
        for part in job.get("parts", []):
            index, size = part["index"], part.get("log_size") or 0
            tailer = self.tailers.get(index)
            if tailer is None or tailer.printed:
                continue
            seen = self.from_portal.get(index)
            if seen is None:
                if not size:
                    continue
                tailer.stop()
                seen = self.from_portal[index] = 0
            new = size - seen
            if new <= 0:
                continue
            tail = part.get("log_tail") or ""
            text = tail[-new:] if new <= len(tail) else "[…]\n" + tail
            label = remote.label_for(index, show)
            with remote._print_lock:
                for line in clean_lines(text):
                    sys.stdout.write(f"{label}{line}\n")
                sys.stdout.flush()
            self.from_portal[index] = size

    def _finish(self, job: dict) -> None:
        """Let each tail print the log's last lines (it ends with the job's supervisor),
        and fetch from the portal the log of a worker ssh could not follow."""
        deadline = time.monotonic() + 15
        for tailer in self.tailers.values():
            tailer.wait(deadline - time.monotonic())
        show = len(self.tailers) > 1
        started = {p["index"] for p in job.get("parts", []) if p.get("started_at")}
        for index, tailer in self.tailers.items():
            tailer.stop()
            if tailer.printed or index not in started or index in self.from_portal:
                continue
            try:
                print_whole_log(self.api, self.path, index, remote.label_for(index, show))
            except CliError as exc:
                self.say(f"The log of worker {index} cannot be read: {exc.message}")


def print_whole_log(api, job_path: str, index: int, label: str) -> None:
    """A worker's whole log as the portal reads it from the worker."""
    response = api.send("GET", f"{job_path}/workers/{index}/log")
    text = response.text
    with remote._print_lock:
        for line in clean_lines(text):
            sys.stdout.write(f"{label}{line}\n")
        sys.stdout.flush()

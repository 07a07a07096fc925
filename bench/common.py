"""What both benchmarks share: a throw-away PostgreSQL database, Django configured
through the environment (so the Celery processes started here see the same world),
a Celery worker and beat as real subprocesses, the timing events they write, and
plain-text tables."""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
POSTGRES_ADMIN_URL = os.environ.get(
    "BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


class Stack:
    """One benchmark run's database, scratch directory, environment and subprocesses.
    ``close()`` stops the subprocesses (by pid) and drops the database."""

    def __init__(self, name: str):
        self.tag = f"{name}_{os.getpid()}_{secrets.token_hex(2)}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"tpu-portal-{name}-"))
        self.database = f"tpu_portal_{self.tag}"
        self.events = Events(self.dir / "events.jsonl")
        self.env: dict[str, str] = {
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "PORTAL_TEST_BACKEND": "services",
            "TEST_REDIS_URL": REDIS_URL,
            "PORTAL_TEST_DATABASE_NAME": self.database,
            "PORTAL_TEST_BROKER_URL": REDIS_URL,
            "PORTAL_TEST_VAR_DIR": str(self.dir / f"var-{self.tag}"),
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "BENCH_QUEUE": f"bench-{self.tag}",
            "BENCH_EVENTS": str(self.events.path),
            "LOG_LEVEL": "INFO",
        }
        self.processes: list[tuple[str, subprocess.Popen, object]] = []
        self._database_made = False

    # --- Django and the database -------------------------------------------------

    def setup_django(self, **extra: str) -> None:
        """Export the environment, create and migrate the database, set Django up."""
        self.env.update({k: str(v) for k, v in extra.items()})
        os.environ.update(self.env)
        sys.path.insert(0, str(ROOT))
        import psycopg

        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.database}"')
        self._database_made = True
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)

    # --- Celery processes --------------------------------------------------------

    def _start(self, role: str, args: list[str], ready: str, timeout: float = 60.0):
        log_path = self.dir / f"celery-{role}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen(
            [PYTHON, "-m", "celery", "-A", "bench.celeryapp", role, *args],
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append((role, proc, log))
        deadline = time.monotonic() + timeout
        while ready not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"celery {role} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        return proc

    def start_worker(self) -> subprocess.Popen:
        """``celery worker`` as the README runs it (prefork, one process per core), on
        this run's queue."""
        return self._start(
            "worker",
            ["-Q", self.env["BENCH_QUEUE"], "-n", f"{self.tag}@%h", "--loglevel=INFO",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            ready=" ready.",
        )  # fmt: skip

    def start_beat(self) -> subprocess.Popen:
        return self._start(
            "beat",
            [
                "--loglevel=INFO",
                "-s",
                str(Path(self.env["PORTAL_TEST_VAR_DIR"]) / "celerybeat-schedule"),
            ],
            ready="beat: Starting",
        )

    def log(self, role: str) -> str:
        return (self.dir / f"celery-{role}.log").read_text(errors="replace")

    def stop_processes(self) -> None:
        """Stop the Celery processes this run started (by pid), keeping the database."""
        for _, proc, _ in reversed(self.processes):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, log in reversed(self.processes):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
        self.processes = []

    def close(self) -> None:
        self.stop_processes()
        if self._database_made:
            from django.db import connections

            connections.close_all()
            import psycopg

            with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            self._database_made = False
        self._clear_redis()

    def _clear_redis(self) -> None:
        """Remove this run's queue and cache keys from the shared Redis."""
        try:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            names = [self.env["BENCH_QUEUE"]]
            names += list(client.scan_iter(match=f"*{self.tag}*", count=1000))
            if names:
                client.delete(*names)
        except Exception as exc:
            print(f"(could not clear Redis keys: {exc})", file=sys.stderr)


class Events:
    """The JSON lines the probes in bench.celeryapp append."""

    def __init__(self, path: Path):
        self.path = path

    def all(self) -> list[dict]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def between(self, start: float, end: float) -> list[dict]:
        return [e for e in self.all() if start <= e.get("start", e.get("t", 0)) <= end]

    def wait_idle(self, timeout: float = 10.0, settle: float = 0.3) -> None:
        """Until every task that started has ended and nothing started for ``settle``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.all()
            started = {e["id"] for e in events if e["kind"] == "task_start"}
            ended = {e["id"] for e in events if e["kind"] == "task_end"}
            last = max((e.get("t", 0) for e in events), default=0)
            if started <= ended and time.time() - last > settle:
                return
            time.sleep(0.05)


def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (pastes into the README as is)."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def machine() -> str:
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{os.cpu_count()} cores ({model or platform.machine()}), {platform.platform()}; "
        f"load average now {load}"
    )


def run_on_fleet(bench) -> int:
    """Starts a fleet bench, runs it and takes its scene down whatever happens; the
    fleet's network namespaces need root."""
    if os.geteuid() != 0:
        print("the fleet needs root (network namespaces)", file=sys.stderr)
        return 2
    try:
        bench.start()
        bench.run()
    finally:
        bench.close()
    return 0

"""All workers of a TPU VM at once: one connection and one script run per worker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings

from tpus.remote import scripts, ssh
from tpus.remote.errors import RemoteError
from tpus.remote.ssh import ScriptResult, Worker

Data = bytes | str | Callable[[Worker], bytes | str]


@dataclass
class WorkerOutcome:
    """One worker's part of a run: its answer, or the error that stopped it."""

    worker: Worker
    result: ScriptResult | None = None
    error: RemoteError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def run_script(
    worker: Worker, script: str | scripts.Script, data: bytes | str = b"", **options
) -> ScriptResult:
    """Run a shipped script (by file name) on one worker; raises RemoteError."""
    return ssh.execute(worker, _script(script), _bytes(data), **options)


def run_on_workers(
    workers: Sequence[Worker],
    script: str | scripts.Script,
    data: Data = b"",
    *,
    max_parallel: int | None = None,
    dry_run: bool | None = None,
) -> list[WorkerOutcome]:
    """Run ``script`` on every worker in parallel (at most ``PORTAL_REMOTE_MAX_PARALLEL``
    at a time). ``data`` is the same for all, or a function of the worker. Outcomes come
    back in the order of ``workers``; nothing is retried here (callers decide, from
    ``error.retryable``)."""
    if not workers:
        return []
    loaded = _script(script)
    limit = max(1, min(max_parallel or settings.PORTAL_REMOTE_MAX_PARALLEL, len(workers)))

    def one(worker: Worker) -> WorkerOutcome:
        payload = data(worker) if callable(data) else data
        try:
            return WorkerOutcome(
                worker, ssh.execute(worker, loaded, _bytes(payload), dry_run=dry_run)
            )
        except RemoteError as exc:
            return WorkerOutcome(worker, error=exc)

    if limit == 1:
        return [one(worker) for worker in workers]
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="remote") as pool:
        return list(pool.map(one, workers))


def _script(script: str | scripts.Script) -> scripts.Script:
    return script if isinstance(script, scripts.Script) else scripts.load(script)


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)

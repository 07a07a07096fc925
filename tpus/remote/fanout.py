"""All workers of a TPU VM at once: one connection and one script run per worker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass

from django.conf import settings

from tpus.remote import scripts, ssh, threads
from tpus.remote.errors import RemoteError
from tpus.remote.ssh import ScriptResult, Worker

Data = bytes | str | Callable[[Worker], bytes | str]
# How often ``Sessions.begin`` asks whether to give up while workers have not answered.
GIVE_UP_LOOK_SECONDS = 0.5


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
    keep: bool = True,
) -> list[WorkerOutcome]:
    """Run ``script`` on every worker in parallel (at most ``PORTAL_REMOTE_MAX_PARALLEL``
    at a time). ``data`` is the same for all, or a function of the worker. Outcomes come
    back in the order of ``workers``; nothing is retried here (callers decide, from
    ``error.retryable``). ``keep``: see ``Sessions``."""
    with Sessions(workers, max_parallel=max_parallel, keep=keep) as sessions:
        return sessions.run(script, data, dry_run=dry_run)


class Sessions:
    """Every worker of a VM over one connection each, kept for several runs in parallel
    (a job's pre-flight on every worker, then its start on every worker): one login per
    worker instead of one per step. A connection that broke is made again by the next
    run. Each is taken from those kept from earlier runs when there is one, and given
    back to be kept on leaving the ``with`` block (``ssh.Connection``); ``keep=False``:
    new connections only, closed on leaving (a check that the workers accept the login
    now)."""

    def __init__(
        self, workers: Sequence[Worker], *, max_parallel: int | None = None, keep: bool = True
    ):
        self.workers = list(workers)
        self.connections = {id(w): ssh.Connection(w, keep=keep) for w in self.workers}
        self.limit = max(
            1, min(max_parallel or settings.PORTAL_REMOTE_MAX_PARALLEL, len(workers) or 1)
        )

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc) -> None:
        for connection in self.connections.values():
            connection.close()

    def run(
        self,
        script: str | scripts.Script,
        data: Data = b"",
        *,
        only: Sequence[Worker] | None = None,
        dry_run: bool | None = None,
    ) -> list[WorkerOutcome]:
        """Like ``run_on_workers``, on these connections (``only``: some of the workers)."""
        chosen = self.workers if only is None else list(only)
        if not chosen:
            return []
        loaded = _script(script)

        def one(worker: Worker) -> WorkerOutcome:
            payload = data(worker) if callable(data) else data
            try:
                connection = self.connections[id(worker)]
                return WorkerOutcome(
                    worker, connection.run(loaded, _bytes(payload), dry_run=dry_run)
                )
            except RemoteError as exc:
                return WorkerOutcome(worker, error=exc)

        return self._map(one, chosen)

    def begin(
        self,
        first: str | scripts.Script,
        data: Data,
        then: str | scripts.Script,
        *,
        then_data: Data | None = None,
        dry_run: bool | None = None,
        give_up: Callable[[], bool] | None = None,
    ) -> Held:
        """Run ``first`` on every worker in parallel, each in one exec (or one request
        to the connection's kept shell) that then waits for the word to run ``then``
        (``ssh.Connection.begin``). The Held answer has
        every worker's first outcome; its ``go`` runs ``then`` everywhere, and leaving
        its ``with`` block without ``go`` stops every worker with nothing more done.

        ``give_up`` is asked about twice a second while workers have not answered;
        once it says yes, the connections are closed (each worker's exec sees the end
        of its stdin and does nothing more) and those workers' outcomes are errors.

        ``then_data`` (the same for all, or a function of the worker): ``then`` runs at
        once after ``first`` with it and reads the word itself (``Connection.begin``)."""
        first, then = _script(first), _script(then)

        def one(worker: Worker):
            payload = data(worker) if callable(data) else data
            early = then_data(worker) if callable(then_data) else then_data
            try:
                step = self.connections[id(worker)].begin(
                    first, _bytes(payload), then,
                    then_data=None if early is None else _bytes(early), dry_run=dry_run,
                )  # fmt: skip
                return WorkerOutcome(worker, step.result), step
            except RemoteError as exc:
                return WorkerOutcome(worker, error=exc), None

        if give_up is None:
            answers = self._map(one, self.workers)
        else:
            # Even one worker runs beside this thread, which keeps asking give_up.
            started = threads.start_all(one, self.workers, self.limit)
            futures = dict(zip(started, self.workers, strict=True))
            try:
                while pending := wait(futures, timeout=GIVE_UP_LOOK_SECONDS).not_done:
                    if give_up():
                        for future in pending:
                            self.connections[id(futures[future])].interrupt()
                        break
                answers = [future.result() for future in started]
            finally:
                for connection in self.connections.values():
                    connection.stopped = False  # every run of this begin is over
        return Held(self, [o for o, _ in answers], [s for _, s in answers], then)

    def _map(self, one, chosen):
        if self.limit == 1:
            return [one(worker) for worker in chosen]
        return [future.result() for future in threads.start_all(one, chosen, self.limit)]


class Held:
    """Every worker waiting between the two scripts of ``Sessions.begin``."""

    def __init__(
        self, sessions: Sessions, first: list[WorkerOutcome], steps: list, then: scripts.Script
    ):
        self.sessions = sessions
        self.first = first
        self.steps = steps
        self.then = then

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def go(self, data: Data = b"") -> list[WorkerOutcome]:
        """The word to every worker: its second script runs with ``data`` (the same for
        all, or a function of the worker). Outcomes in the order of the workers; a
        worker whose first script failed has that error again."""
        pairs = list(zip(self.sessions.workers, self.first, self.steps, strict=True))
        self.steps = [None] * len(self.steps)

        def one(item) -> WorkerOutcome:
            worker, first, step = item
            if step is None:
                return WorkerOutcome(worker, error=first.error)
            payload = data(worker) if callable(data) else data
            try:
                return WorkerOutcome(worker, step.go(_bytes(payload)))
            except RemoteError as exc:
                return WorkerOutcome(worker, error=exc)

        return self.sessions._map(one, pairs)

    def stop(self) -> None:
        """No worker runs the second script (each sees the end of its stdin)."""
        steps, self.steps = self.steps, [None] * len(self.steps)
        for step in steps:
            if step is not None:
                step.stop()


def _script(script: str | scripts.Script) -> scripts.Script:
    return script if isinstance(script, scripts.Script) else scripts.load(script)


def _bytes(data):
    """Text as bytes; bytes as they are; anything else is an iterable of chunks
    (``ssh.Connection.run`` streams it)."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    return data

"""A worker's whole job log, for a download from the page or the API."""

from __future__ import annotations

from collections.abc import Iterator

from tpus.models import Job
from tpus.remote import jobs as wire
from tpus.remote import run_script
from tpus.services.hosts import remote_worker
from tpus.services.labkeys import login_for


def whole_log(job: Job, index: int) -> Iterator[bytes]:
    """The log of worker ``index``'s part of ``job``, read from the worker a chunk at a
    time. The first chunk is read here, so a worker that cannot give the log raises
    LookupError before any response begins; one that fails half-way ends the download
    with a line that says so (the status line has gone by then)."""
    chunks = read_log(job, index)
    first = next(chunks, b"")

    def stream() -> Iterator[bytes]:
        if first:
            yield first
        try:
            yield from chunks
        except LookupError as exc:
            yield f"\n[TPU Portal: the rest of the log could not be read: {exc}]\n".encode()

    return stream()


def filename(job: Job, index: int) -> str:
    return f"job-{job.pk}-{job.vm.name}-worker-{index}.log"


def read_log(job: Job, index: int, *, chunk: int = wire.MAX_LOG_BYTES):
    """The whole log of one worker's part, read from the worker a chunk at a time
    (bytes). Raises LookupError when the worker cannot give it."""
    worker = job.vm.workers.get(index=index)
    remote = remote_worker(worker, login_for(job.vm.lab))
    offset = 0
    while True:
        try:
            result = run_script(
                remote, "job-status.sh", wire.encode_status({job.host_id: offset}, chunk)
            )
            status = wire.parse_status(result.pairs).jobs.get(job.host_id)
        except Exception as exc:
            raise LookupError(
                f"worker {index} ({worker.alias}) cannot give the log: {exc}"
            ) from exc
        if status is None or status.state == "unknown":
            raise LookupError(f"worker {index} ({worker.alias}) no longer has the job's log")
        if not status.log:
            return
        yield status.log
        offset = status.log_offset + len(status.log)
        if offset >= status.log_size:
            return

"""A worker's whole job log, for a download from the page or the API."""

from __future__ import annotations

from collections.abc import Iterator

from tpus.models import Job
from tpus.services import jobs


def whole_log(job: Job, index: int) -> Iterator[bytes]:
    """The log of worker ``index``'s part of ``job``, read from the worker a chunk at a
    time. The first chunk is read here, so a worker that cannot give the log raises
    LookupError before any response begins; one that fails half-way ends the download
    with a line that says so (the status line has gone by then)."""
    chunks = jobs.read_log(job, index)
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

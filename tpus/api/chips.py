"""The ``chips`` of a TPU VM in the API: each chip's runtime metrics as the job poll
last read them from libtpu (``services.chip_metrics``), in a VM's own object and in
the usage ``now`` rows (which ``tpu ls`` reads)."""

from __future__ import annotations

from datetime import datetime

from ninja import Schema


class ChipOut(Schema):
    chip: int  # libtpu's device id on the worker
    hbm_used_bytes: int
    hbm_total_bytes: int
    duty_cycle_percent: float  # the share of time the chip's TensorCores were busy
    # The mean over the samples the portal keeps (PORTAL_CHIP_METRICS_KEEP_MINUTES, an
    # hour by default); null without any.
    duty_cycle_percent_mean: float | None
    # Who holds it: "job <id> of <username>" for the portal's job on the VM, or
    # "<user> (pid <pid>)" for a process outside the portal; "" when unknown.
    holder: str


class WorkerChipsOut(Schema):
    worker: int
    # Why the worker has no metrics (nothing serves them, no answer); "" when read.
    none: str
    chips: list[ChipOut]


class ChipsSummaryOut(Schema):
    chips: int
    hbm_used_bytes: int
    hbm_total_bytes: int
    duty_cycle_percent: float  # the mean over the chips


class ChipsOut(Schema):
    """As of ``read_at`` (null: never read); ``summary`` is null when no chip was."""

    read_at: datetime | None
    summary: ChipsSummaryOut | None
    workers: list[WorkerChipsOut]

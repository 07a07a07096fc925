"""Jobs: a person's command run on every worker of a TPU VM, one job at a time per VM.

A job is desired state like a grant: the row says what should run; the job poll
(``tpus/services/jobs.py``) learns from the workers what does. The queue of a VM is
its jobs in ``QUEUED`` (and ``BLOCKED``) order of ``queued_at``; at most one job of a
VM is between ``VALIDATING`` and ``CANCELLING`` at any time, and the workers' own lock
makes two jobs on one TPU impossible even if the database were wrong.
"""

from __future__ import annotations

import re
import shlex
import signal
from pathlib import PurePosixPath

from django.conf import settings
from django.db import models
from django.utils import timezone


class JobState(models.TextChoices):
    QUEUED = "queued", "Queued"
    BLOCKED = "blocked", "Blocked: the TPU is held outside the portal"
    VALIDATING = "validating", "Validating"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    CANCELLING = "cancelling", "Cancelling"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Lost"
    REJECTED = "rejected", "Rejected by the pre-flight"


# Waiting for the TPU, in line.
WAITING_STATES = (JobState.QUEUED, JobState.BLOCKED)
# Holding the VM's one place: at most one job of a VM is in one of these.
ACTIVE_STATES = (
    JobState.VALIDATING,
    JobState.STARTING,
    JobState.RUNNING,
    JobState.CANCELLING,
)
ENDED_STATES = (
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.LOST,
    JobState.REJECTED,
)


class Provisioning(models.TextChoices):
    """Which VMs of a kind a job submitted to the pool may run on."""

    ANY = "any", "On-demand or spot"
    ON_DEMAND = "on_demand", "On-demand only"
    SPOT = "spot", "Spot only"


class Job(models.Model):
    """ "milo runs train.py on tpu5": the command, the environment it runs in, and how
    it went. The same ``host_id`` names the job on every worker.

    A job names its VM, or a kind of VM of its lab (``accelerator_type``, optionally
    ``zones`` and ``provisioning``: "any free v4-8"); such a job has no VM until the
    scheduler (``services.scheduler``) places it on a free one, and from then on is a
    job of that VM like any other."""

    State = JobState
    Provisioning = Provisioning

    vm = models.ForeignKey(
        "tpus.TpuVm", null=True, blank=True, on_delete=models.CASCADE, related_name="jobs"
    )
    # The lab the job was submitted in (the VM's lab once it has one).
    lab = models.ForeignKey(
        "tpus.Lab", null=True, blank=True, on_delete=models.CASCADE, related_name="jobs"
    )
    # The kind of VM asked for; empty for a job submitted to a VM by name.
    accelerator_type = models.CharField(max_length=40, blank=True)
    # Zones the job may run in ([] for any of the lab's), and on-demand or spot.
    zones = models.JSONField(default=list, blank=True)
    provisioning = models.CharField(
        max_length=10, choices=Provisioning.choices, default=Provisioning.ANY
    )
    # When the scheduler gave it its VM (None for a job submitted to a VM by name).
    placed_at = models.DateTimeField(null=True, blank=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    # The job's name on the workers (its folder, the lock's holder): unique for good,
    # so a job id is never reused on a host even after the database is rebuilt.
    host_id = models.CharField(max_length=64, unique=True)
    state = models.CharField(max_length=12, choices=JobState.choices, default=JobState.QUEUED)
    # What to run. ``script``: a file in the home run with the environment's python,
    # followed by ``args``; without it ``args`` is the whole command.
    script = models.CharField(max_length=4096, blank=True)
    args = models.JSONField(default=list)
    # A venv in the home; empty: the VM's system Python.
    python = models.CharField(max_length=4096, blank=True)
    cwd = models.CharField(max_length=4096, blank=True)
    # [[name, value], ...] in the order given.
    env = models.JSONField(default=list, blank=True)
    # TCMalloc in LD_PRELOAD when the VM has it, unless the person said no.
    use_tcmalloc = models.BooleanField(default=True)
    time_limit_minutes = models.PositiveIntegerField(null=True, blank=True)
    notify = models.BooleanField("email me when it ends", default=False)
    # Lost because Google took the VM back (a preemption): queued again at the head of
    # the line, to start when the VM is back.
    rerun_after_preemption = models.BooleanField("run again after a preemption", default=False)
    rerun_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="reruns"
    )
    # Which run of the job this is: 1, or one more than the run lost with its VM that
    # it runs again (``services.jobs.run_again_after_preemption``, bounded by
    # ``MAX_MOVES`` for a job submitted to a kind).
    attempt = models.PositiveSmallIntegerField(default=1)
    # A pool job run again after its VM was lost: the VM it was lost with, what
    # happened to it ("preempted", "deleted" …), and when it went back to the head of
    # its kind's line (ahead of fair share, first come first served among such jobs).
    moved_from = models.CharField(max_length=128, blank=True)
    moved_why = models.CharField(max_length=40, blank=True)
    returned_at = models.DateTimeField(null=True, blank=True)

    # The workdir it carries (``services.snapshots``), placed at ``cwd`` on every worker
    # before its command starts; its digest stays after the snapshot expired.
    snapshot = models.ForeignKey(
        "tpus.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    snapshot_digest = models.CharField(max_length=64, blank=True)

    queued_at = models.DateTimeField(default=timezone.now)
    # When the portal began with it (the pre-flight), when every worker ran it, when
    # the last worker ended.
    begun_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancelled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # How many workers it runs on (its parts), set when the portal begins with it: what
    # usage multiplies its time by, without counting the parts of every job.
    worker_count = models.PositiveSmallIntegerField(default=0)
    # Why it ended other than by succeeding, in words a person can act on: the failed
    # pre-flight checks per worker, the worker whose process failed, the reboot.
    reason = models.TextField(blank=True)
    # The pre-flight's lines per worker index: {"0": [[check, status, detail], ...]}.
    preflight = models.JSONField(default=dict, blank=True)
    # How many passes died while validating it: bounded, so a job whose pre-flight
    # keeps a pass from finishing is refused instead of being tried forever.
    interrupted_validations = models.PositiveSmallIntegerField(default=0)
    notified_at = models.DateTimeField(null=True, blank=True)
    # Any change an API client can see (``updated_since``).
    changed_at = models.DateTimeField(default=timezone.now)
    # Its time is in the per-day usage rows (``UsageDay``), once it has ended; until
    # then usage reads it from here (``services.usage``).
    usage_counted = models.BooleanField(default=False)

    class Meta:
        ordering = ["-queued_at", "-id"]
        indexes = [
            models.Index(fields=["vm", "state", "queued_at"]),
            models.Index(fields=["user", "queued_at"]),
            models.Index(fields=["vm", "ended_at"]),
            # The pool's line: the jobs of a lab still waiting for a VM of their kind.
            models.Index(
                fields=["lab", "accelerator_type", "queued_at"],
                condition=models.Q(vm__isnull=True),
                name="job_waiting_for_a_vm",
            ),
            # The few jobs usage reads one by one: running, or ended and not yet in
            # the per-day rows.
            models.Index(
                fields=["vm"],
                condition=models.Q(started_at__isnull=False, usage_counted=False),
                name="job_not_in_usage_days",
            ),
        ]
        constraints = [
            # The database half of "one job at a time per TPU" (the hosts' lock is
            # the other): two jobs of one VM can never both hold its place.
            models.UniqueConstraint(
                fields=["vm"],
                condition=models.Q(state__in=[s.value for s in ACTIVE_STATES]),
                name="one_active_job_per_vm",
            ),
            # A job without a VM asked for a kind, and only waits (or was cancelled
            # while it waited): nothing runs nowhere.
            models.CheckConstraint(
                condition=models.Q(vm__isnull=False)
                | (
                    ~models.Q(accelerator_type="")
                    & models.Q(state__in=[s.value for s in (*WAITING_STATES, JobState.CANCELLED)])
                ),
                name="job_without_vm_waits_for_a_kind",
            ),
        ]

    def __str__(self) -> str:
        if self.vm_id is None:
            return f"job {self.pk} for a {self.accelerator_type}"
        return f"job {self.pk} on {self.vm_id}"

    @property
    def is_pool_job(self) -> bool:
        """Submitted to a kind of VM rather than to one VM by name."""
        return bool(self.accelerator_type)

    @property
    def is_unplaced(self) -> bool:
        """Waiting for the scheduler to give it a VM."""
        return self.vm_id is None

    @property
    def kind_text(self) -> str:
        """The kind asked for, for people: ``v4-8``, ``v4-8 in us-central2-b, spot``."""
        words = self.accelerator_type
        if self.zones:
            words += " in " + ", ".join(self.zones)
        if self.provisioning != Provisioning.ANY:
            words += ", " + ("spot" if self.provisioning == Provisioning.SPOT else "on-demand")
        return words

    @property
    def where_text(self) -> str:
        """Where it runs (its VM's name), or the kind it waits for (``any v4-8``)."""
        if self.vm_id is not None:
            return self.vm.name
        return f"any {self.kind_text}"

    @property
    def move_text(self) -> str:
        """Where a pool job run again after its VM was lost went, for its owner: "tpu7
        was preempted; your job moved to tpu3." ('' for any other job)."""
        if not self.moved_from:
            return ""
        lost = f"{self.moved_from} was {self.moved_why}"
        if self.vm_id is not None:
            return f"{lost}; your job moved to {self.vm.name}."
        return f"{lost}; your job waits at the head of the line for another {self.kind_text}."

    @property
    def argv(self) -> list[str]:
        """The command as the workers run it (the environment's python first, for a
        script)."""
        if self.script:
            return ["python3", self.script, *self.args]
        return list(self.args)

    @property
    def command_text(self) -> str:
        """The command for people to read (quoted like a shell would need it)."""
        return join_words(self.argv)

    @property
    def program(self) -> list[str]:
        """What the job runs, without its arguments: all that people who share the VM
        see of another person's job. For Python that is the script or module it runs
        (``python3 train.py``, ``python3 -m train``), without the interpreter's flags."""
        argv = self.argv
        if not argv:
            return []
        words, rest = [argv[0]], argv[1:]
        if _PYTHON.fullmatch(PurePosixPath(argv[0]).name):
            while rest and _PYTHON_FLAGS.fullmatch(rest[0]):
                rest = rest[1:]
            if rest[:1] == ["-m"] and len(rest) > 1:
                words += rest[:2]
            elif rest and not rest[0].startswith("-"):
                words.append(rest[0])
        return words

    @property
    def program_text(self) -> str:
        """``program`` for people to read, with ``…`` where arguments were left out."""
        words = self.program
        more = len(words) < len(self.argv)
        return join_words(words) + (" …" if more else "")

    @property
    def is_waiting(self) -> bool:
        return self.state in WAITING_STATES

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def has_ended(self) -> bool:
        return self.state in ENDED_STATES

    @property
    def can_cancel(self) -> bool:
        return self.state in (
            *WAITING_STATES,
            JobState.VALIDATING,
            JobState.STARTING,
            JobState.RUNNING,
        )

    @property
    def duration(self):
        if not self.started_at:
            return None
        return (self.ended_at or timezone.now()) - self.started_at

    @property
    def exit_code(self) -> int | None:
        """The job's own exit code once it has ended: 0 when it succeeded; else that of
        the worker whose process failed first (the one ``reason`` names), 128 + N for a
        process killed by signal N as a shell says it (a cancelled job's processes were
        killed by TERM); None while it waits or runs, and for an ended job in which no
        process failed (rejected by the pre-flight, cancelled before it started)."""
        if self.state == JobState.SUCCEEDED:
            return 0
        if not self.has_ended:
            return None
        failed = first_failed(self.parts.all(), self.ended_at or timezone.now())
        return failed.exit_code if failed is not None else None


_PYTHON = re.compile(r"python[0-9.]*")
# Flags of python that take no value: skipped to find the script.
_PYTHON_FLAGS = re.compile(r"-[bBdEhiIOqsSuvx]+")
_PLAIN = re.compile(r"[A-Za-z0-9@%+=:,./_~-]+")


def join_words(words) -> str:
    """Words as a shell would need them, the easiest to read way: bare when they can
    be, in double quotes when only an apostrophe needs it (``"milo's run"``, not
    ``'milo'"'"'s run'``), else in single quotes."""
    out = []
    for word in words:
        if _PLAIN.fullmatch(word):
            out.append(word)
        elif "'" in word and not any(c in word for c in '"\\$`!'):
            out.append(f'"{word}"')
        else:
            out.append(shlex.quote(word))
    return " ".join(out)


class JobWorkerState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    ENDED = "ended", "Ended"
    LOST = "lost", "Lost"
    NOT_STARTED = "not_started", "Not started"


class JobWorker(models.Model):
    """One worker's part of a job: its process, its exit, the tail of its log."""

    State = JobWorkerState

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="parts")
    worker = models.ForeignKey("tpus.Worker", on_delete=models.CASCADE, related_name="+")
    index = models.PositiveSmallIntegerField()
    state = models.CharField(
        max_length=12, choices=JobWorkerState.choices, default=JobWorkerState.PENDING
    )
    pid = models.PositiveIntegerField(null=True, blank=True)
    boot_id = models.CharField(max_length=64, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    exit_status = models.IntegerField(null=True, blank=True)
    signal = models.CharField(max_length=16, blank=True)
    # The log: how many bytes the portal has read, how long it is on the worker, and
    # the last of it (bounded) for the page.
    log_offset = models.BigIntegerField(default=0)
    log_size = models.BigIntegerField(default=0)
    log_tail = models.TextField(blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="one_part_per_worker")]

    def __str__(self) -> str:
        return f"job {self.job_id} worker {self.index}"

    @property
    def has_log(self) -> bool:
        """Whether the job's command was started on this worker, so that it has a log
        there to download (a rejected or refused job started nothing)."""
        return self.pid is not None or self.state in (
            JobWorkerState.RUNNING,
            JobWorkerState.ENDED,
            JobWorkerState.LOST,
        )

    @property
    def has_failed(self) -> bool:
        """Whether its process ended with a non-zero status or by a signal."""
        return self.state == JobWorkerState.ENDED and bool(self.exit_status or self.signal)

    @property
    def exit_code(self) -> int | None:
        """The status a shell would give the process: its exit status, or 128 + N when
        signal N killed it (None for a signal this system does not number)."""
        if self.signal:
            try:
                return 128 + signal.Signals[f"SIG{self.signal.removeprefix('SIG')}"].value
            except KeyError:
                return None
        return self.exit_status

    @property
    def outcome(self) -> str:
        if self.signal:
            return f"killed by {self.signal}"
        if self.exit_status is not None:
            return f"exit {self.exit_status}"
        return self.get_state_display().lower()


def first_failed(parts, now) -> JobWorker | None:
    """The part whose process failed first (by when it ended, then by worker), or None:
    the worker a failed job's reason names and its exit code comes from."""
    failed = [p for p in parts if p.has_failed]
    return min(failed, key=lambda p: (p.ended_at or now, p.index), default=None)

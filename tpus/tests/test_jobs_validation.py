"""How the VM's pass judges a job's pre-flight and what a refusal leaves on the job:
every worker's checks as rows (with what the portal judged itself), one sentence for a
refusal found on every worker with a hint, a cancel that arrives meanwhile, and a job
left in validating by a pass that died. The workers' answers are given as the remote
door would return them; the fleet tests (test_jobs_service.py) drive real hosts."""

from __future__ import annotations

import pytest

from portal.audit import AuditAction
from tpus.models import AuditEvent, Job, JobWorker
from tpus.models.jobs import JobState
from tpus.remote import RemoteError, ScriptResult, WorkerOutcome
from tpus.services import job_engine, jobs
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene

VERSIONS = "python=3.11.0 jax=0.4.30 jaxlib=0.4.30 libtpu=none requests=none libtpu_pin=none"
SHA = "a" * 64


def answer(*checks: tuple[str, str, str]) -> ScriptResult:
    pairs = [("check", f"{name} {status} {detail}") for name, status, detail in checks]
    return ScriptResult(None, "job-preflight.sh", 0, pairs=pairs)


def passing(script_sha: str = SHA, **changed) -> ScriptResult:
    checks = {
        "chips": ("ok", "4 of 4 at /dev/accel*"),
        "python": ("ok", VERSIONS),
        "script": ("ok", f"sha256={script_sha} /home/milo/train.py"),
    }
    checks.update(changed)
    return answer(*[(name, *value) for name, value in checks.items()])


class Held:
    """Every worker's pre-flight answered (``Sessions.begin``), nobody told to start."""

    def __init__(self, first):
        self.first = first

    def go(self, data=b""):
        raise AssertionError("a refused job must not start anywhere")


def judge(job: Job, answers: list, monkeypatch=None) -> job_engine.PassReport:
    """The pass's judgement of ``answers`` (ScriptResult or RemoteError per worker), as
    right after the pre-flight ran on the job's workers."""
    vm = job.vm
    workers = list(vm.workers.order_by("index"))
    Job.objects.filter(pk=job.pk).update(state=JobState.VALIDATING)
    job.refresh_from_db()
    outcomes = [
        WorkerOutcome(None, error=a) if isinstance(a, RemoteError) else WorkerOutcome(None, a)
        for a in answers
    ]
    report = job_engine.PassReport(vm.pk)
    job_engine._judge_and_start(job, vm, workers, None, Held(outcomes), report)
    job.refresh_from_db()
    return report


@pytest.fixture
def pod(scene):
    """A 4-worker VM milo may run jobs on."""
    from tpus.models import Grant

    vm = make_vm(scene.lab, "pod5", workers=4)
    Grant.objects.create(user=scene.milo, vm=vm, state="active")
    return vm


def test_a_refusal_found_on_every_worker_is_said_once_with_a_hint(scene, pod):
    job = make_job(pod, scene.milo, "queued", script="/home/milo/train.py", args=[])
    missing = "/home/milo/train.py does not exist or milo cannot reach it"
    report = judge(job, [passing(script=("fail", missing))] * 4)
    assert job.state == JobState.REJECTED and report.ended == [job.pk]
    assert job.reason == (
        f"The pre-flight failed on every worker (4): script: {missing}. "
        "Copy your code to every worker, or keep it on a data disk."
    )
    for index in range(4):
        assert ["script", "fail", missing] in job.preflight[str(index)]


def test_a_script_that_differs_names_the_worker_and_its_row_fails(scene, pod):
    job = make_job(pod, scene.milo, "queued", script="/home/milo/train.py", args=[])
    judge(job, [passing(), passing(), passing(), passing(script_sha="b" * 64)])
    assert job.state == JobState.REJECTED
    assert job.reason == (
        "The pre-flight failed on worker 3 (pod5-w3): script: differs from worker 0's copy. "
        "Copy your code to every worker, or keep it on a data disk."
    )
    [row] = [r for r in job.preflight["3"] if r[0] == "script"]
    assert row == ["script", "fail", f"differs from worker 0's copy (sha256={'b' * 64} "
                   "/home/milo/train.py)"]  # fmt: skip
    assert ["script", "ok", f"sha256={SHA} /home/milo/train.py"] in job.preflight["0"]


def test_versions_the_portal_judges_make_the_python_row_fail(scene, pod, settings):
    settings.PORTAL_JOB_REQUIRE_LIBTPU = True
    job = make_job(pod, scene.milo, "queued")
    judge(job, [passing()] * 4)
    assert job.state == JobState.REJECTED
    [row] = [r for r in job.preflight["1"] if r[0] == "python"]
    assert row[1] == "fail" and row[2].startswith("libtpu is not installed")
    assert row[2].endswith(f"({VERSIONS})")
    assert "every worker (4): python: libtpu is not installed" in job.reason


def test_details_keep_their_apostrophes(scene):
    job = make_job(scene.vm, scene.milo, "queued", script="/home/milo/train.py", args=[])
    detail = "/home/milo/train.py resolves to /etc/hostname, outside milo's home"
    judge(job, [passing(script=("fail", detail))])
    assert job.reason == f"The pre-flight failed on worker 0 (tpu5-w0): script: {detail}."
    assert ["script", "fail", detail] in job.preflight["0"]


def test_a_pre_flight_that_did_not_finish_in_time_rejects_naming_the_worker(scene, pod, settings):
    settings.PORTAL_REMOTE_SCRIPT_TIMEOUT = 300
    job = make_job(pod, scene.milo, "queued")
    late = RemoteError("the script did not finish within 300 s", kind=RemoteError.TIMEOUT,
                       retryable=True, worker="pod5-w2", script_ran_late=True)  # fmt: skip
    judge(job, [passing(), passing(), late, passing()])
    assert job.state == JobState.REJECTED
    assert job.reason == (
        "The pre-flight failed on worker 2 (pod5-w2): preflight: it did not finish within 300 s."
    )
    assert job.preflight["2"] == [["preflight", "fail", "it did not finish within 300 s"]]
    assert ["chips", "ok", "4 of 4 at /dev/accel*"] in job.preflight["0"]


def test_a_worker_that_cannot_be_reached_keeps_the_job_waiting(scene, pod):
    job = make_job(pod, scene.milo, "queued")
    down = RemoteError("cannot connect: No route to host", kind=RemoteError.UNREACHABLE,
                       retryable=True, worker="pod5-w1")  # fmt: skip
    judge(job, [passing(), down, passing(), passing()])
    assert job.state == JobState.QUEUED
    assert (
        job.reason
        == "Waiting: cannot reach worker 1 (pod5-w1): pod5-w1: cannot connect: No route to host"
    )


def test_a_cancel_that_came_while_the_workers_ran_their_checks_ends_the_job(scene, pod):
    job = make_job(pod, scene.milo, "validating")
    assert jobs.cancel_job(job, scene.milo).state == JobState.CANCELLING
    report = judge_keeping_state(job, [passing()] * 4)
    assert job.state == JobState.CANCELLED and report.ended == [job.pk]
    assert job.reason == "Cancelled before it started." and job.started_at is None
    assert len(job.preflight) == 4  # what the checks found stays with it


def test_a_cancel_of_a_job_that_would_go_back_in_line_ends_it(scene, pod):
    job = make_job(pod, scene.milo, "validating")
    jobs.cancel_job(job, scene.milo)
    held = answer(("chip_holder", "fail", "/dev/accel0 pid=7 user=ann command=python x.py"))
    judge_keeping_state(job, [held, passing(), passing(), passing()])
    assert job.state == JobState.CANCELLED


def judge_keeping_state(job: Job, answers: list) -> job_engine.PassReport:
    workers = list(job.vm.workers.order_by("index"))
    job.refresh_from_db()
    outcomes = [WorkerOutcome(None, a) for a in answers]
    report = job_engine.PassReport(job.vm_id)
    job_engine._judge_and_start(job, job.vm, workers, None, Held(outcomes), report)
    job.refresh_from_db()
    return report


def test_a_job_left_validating_by_a_dead_pass_goes_back_in_line_saying_why(scene):
    job = make_job(scene.vm, scene.milo, "validating")
    job_engine.advance(scene.vm.pk)
    job.refresh_from_db()
    assert job.interrupted_validations == 1
    # Back at the head of the line; this VM's workers cannot be reached in these tests,
    # so the next step of the pass leaves it waiting for them.
    assert job.state == JobState.QUEUED


def test_a_job_whose_pre_flight_was_cut_short_again_and_again_is_rejected_saying_why(scene):
    job = make_job(scene.vm, scene.milo, "validating", interrupted_validations=2)
    report = job_engine.advance(scene.vm.pk)
    job.refresh_from_db()
    assert job.state == JobState.REJECTED and report.ended == [job.pk]
    assert job.reason.startswith("The pre-flight was cut short 3 times")
    assert "Run the job again" in job.reason


# --- the start round, as the pass records it ------------------------------------------


class Started(Held):
    """Every worker passed its pre-flight; the word to start gets ``answers``."""

    def __init__(self, first, answers):
        super().__init__(first)
        self.answers = answers

    def go(self, data=b""):
        return [
            WorkerOutcome(None, error=a) if isinstance(a, RemoteError) else WorkerOutcome(None, a)
            for a in self.answers
        ]


class NoHosts:
    """The pass's workers when nothing is left to stop on them."""

    workers: list = []


def started(pid: int, boot_id: str = "boot-1", at: float = 1_800_000_000.5) -> ScriptResult:
    pairs = [("start", "started"), ("pid", str(pid)), ("boot_id", boot_id),
             ("started_at", str(at))]  # fmt: skip
    return ScriptResult(None, "job-start.sh", 0, pairs=pairs)


def start(job: Job, answers) -> job_engine.PassReport:
    """The pass from the workers' passed pre-flight on: the word, and what each
    worker's start answered (a list, or a ``Started``). The job's parts are as its
    begin made them."""
    workers = list(job.vm.workers.order_by("index"))
    JobWorker.objects.bulk_create(JobWorker(job=job, worker=w, index=w.index) for w in workers)
    Job.objects.filter(pk=job.pk).update(state=JobState.VALIDATING)
    job.refresh_from_db()
    report = job_engine.PassReport(job.vm_id)
    held = answers if isinstance(answers, Started) else Started(None, answers)
    held.first = [WorkerOutcome(None, passing())] * len(workers)
    job_engine._judge_and_start(job, job.vm, workers, NoHosts(), held, report)
    job.refresh_from_db()
    return report


def test_every_worker_started_makes_the_job_running_with_each_workers_process(scene, pod):
    job = make_job(pod, scene.milo, "queued")
    report = start(job, [started(100 + i, boot_id=f"boot-{i}") for i in range(4)])
    assert job.state == JobState.RUNNING and job.started_at is not None
    assert report.started == [job.pk] and report.ended == []
    parts = list(job.parts.order_by("index"))
    assert [(p.state, p.pid, p.boot_id, p.error) for p in parts] == [
        ("running", 100 + i, f"boot-{i}", "") for i in range(4)
    ]
    assert {p.started_at.timestamp() for p in parts} == {1_800_000_000.5}
    event = AuditEvent.objects.get(action=AuditAction.JOB_STARTED)
    assert event.target_user == scene.milo and event.lab == scene.lab
    assert event.summary == f"job {job.pk} on pod5, 4 worker(s)"
    assert event.data == {"job": job.pk, "vm": pod.pk}


def test_a_worker_that_refused_to_start_fails_the_job_and_says_why_on_its_part(scene, pod):
    job = make_job(pod, scene.milo, "queued")
    refused = ScriptResult(None, "job-start.sh", 0, pairs=[("start", "refused busy j7")])
    report = start(job, [started(100), started(101), refused, started(103)])
    assert job.state == JobState.FAILED and report.ended == [job.pk]
    assert job.reason == (
        "It could not start on worker 2 (pod5-w2): the TPU is held by another job (j7)"
    )
    parts = {p.index: p for p in job.parts.all()}
    assert parts[2].state == "not_started" and parts[2].pid is None
    assert parts[2].error == "the TPU is held by another job (j7)"
    assert (parts[3].state, parts[3].pid, parts[3].error) == ("running", 103, "")
    assert not AuditEvent.objects.filter(action=AuditAction.JOB_STARTED).exists()


def test_a_cancel_that_came_during_the_start_round_leaves_the_job_cancelling(scene, pod):
    job = make_job(pod, scene.milo, "queued")

    def cancelled_meanwhile(data=b""):
        jobs.cancel_job(Job.objects.get(pk=job.pk), scene.milo)
        return Started.go(held, data)

    held = Started(None, [started(100 + i) for i in range(4)])
    held.go = cancelled_meanwhile
    report = start(job, held)
    assert job.state == JobState.CANCELLING and report.started == [job.pk]
    assert set(job.parts.values_list("state", flat=True)) == {"running"}

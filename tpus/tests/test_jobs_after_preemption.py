"""A job lost because Google took its VM back runs again when its owner asked for it:
queued at the head of the line (as early as the lost one), to start when the VM is
back; not when they did not ask, nor once they lost access."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from tpus.models import Grant, Job
from tpus.services import jobs
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job

scene = jobs_support.scene


def _lost(scene, *, rerun: bool) -> Job:
    job = make_job(scene.vm, scene.milo, "running")
    Job.objects.filter(pk=job.pk).update(
        state="lost",
        rerun_after_preemption=rerun,
        queued_at=timezone.now() - dt.timedelta(hours=1),
        ended_at=timezone.now(),
    )
    job.refresh_from_db()
    return job


def test_a_lost_job_whose_owner_asked_for_it_goes_back_to_the_head_of_the_line(scene):
    waiting = make_job(scene.vm, scene.ann, "queued")
    lost = _lost(scene, rerun=True)
    again = jobs.run_again_after_preemption(lost)
    assert again is not None and again.rerun_of_id == lost.pk
    again.refresh_from_db()
    assert again.state == "queued" and again.rerun_after_preemption
    assert again.queued_at == lost.queued_at
    assert again.args == lost.args
    line = list(Job.objects.filter(vm=scene.vm, state="queued").order_by("queued_at", "id"))
    assert line == [again, waiting]
    assert "preempted" in again.reason
    assert jobs.run_again_after_preemption(lost) is None  # once


def test_a_lost_job_nobody_asked_to_run_again_stays_lost(scene):
    assert jobs.run_again_after_preemption(_lost(scene, rerun=False)) is None
    assert not Job.objects.filter(state="queued").exists()


def test_no_job_runs_again_for_someone_whose_access_ended(scene):
    lost = _lost(scene, rerun=True)
    Grant.objects.filter(user=scene.milo).update(state="revoked")
    assert jobs.run_again_after_preemption(lost) is None


def test_an_alarm_about_published_keys_only_does_not_hold_jobs_and_a_presented_key_does(scene):
    from tpus.services.job_engine import _unready

    worker = scene.vm.workers.first()
    worker.host_keys = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedKeyOfTheWorker"]
    worker.host_key_mismatch_at = timezone.now()
    worker.host_key_alarm_published = True
    worker.save()
    workers = list(scene.vm.workers.order_by("index"))
    assert _unready(scene.vm, workers) == ""
    worker.host_key_alarm_published = False
    worker.save()
    workers = list(scene.vm.workers.order_by("index"))
    assert "presented another host key" in _unready(scene.vm, workers)


def test_jobs_wait_while_a_vm_back_on_new_machines_is_set_up_again(scene):
    from tpus.models import TpuVm
    from tpus.services.job_engine import _unready

    pinned = ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedKeyOfTheWorker"]
    scene.vm.workers.update(host_keys=pinned)
    TpuVm.objects.filter(pk=scene.vm.pk).update(restore_version=7)
    scene.vm.refresh_from_db()
    workers = list(scene.vm.workers.order_by("index"))
    assert "being set up again" in _unready(scene.vm, workers)
    TpuVm.objects.filter(pk=scene.vm.pk).update(restore_version=None)
    scene.vm.refresh_from_db()
    assert _unready(scene.vm, workers) == ""


def test_a_job_run_again_waits_a_while_for_its_home_on_new_machines_and_no_other(scene, settings):
    from tpus.models import TpuVm
    from tpus.services.job_engine import _home_wait_until

    settings.PORTAL_JOB_RERUN_HOME_WAIT_SECONDS = 600
    lost = _lost(scene, rerun=True)
    again = jobs.run_again_after_preemption(lost)
    restored = timezone.now()
    TpuVm.objects.filter(pk=scene.vm.pk).update(restored_at=restored)
    scene.vm.refresh_from_db()
    until = _home_wait_until(again, scene.vm)
    assert until == restored + dt.timedelta(seconds=600)
    # A job that is not run again after a loss in the VM's last life does not wait …
    plain = make_job(scene.vm, scene.ann, "queued")
    assert _home_wait_until(plain, scene.vm) is None
    # … nor one whose VM has not come back on new machines since, nor once time is up.
    TpuVm.objects.filter(pk=scene.vm.pk).update(restored_at=lost.ended_at - dt.timedelta(1))
    scene.vm.refresh_from_db()
    assert _home_wait_until(again, scene.vm) is None
    TpuVm.objects.filter(pk=scene.vm.pk).update(restored_at=restored - dt.timedelta(hours=1))
    scene.vm.refresh_from_db()
    assert _home_wait_until(again, scene.vm) is None


def test_a_vm_made_anew_after_a_job_began_took_the_job_with_it(scene):
    """Google took the VM back and the keep-alive brought it back before the job pass
    looked: the VM is ready again, but on new machines, so the job is lost to a
    preemption (and runs again when asked for), not to a reboot."""
    from tpus.services.job_engine import _made_anew_under

    job = make_job(scene.vm, scene.milo, "running")
    assert not _made_anew_under(job, scene.vm)
    scene.vm.restore_version = 3  # back, being set up again
    assert _made_anew_under(job, scene.vm)
    scene.vm.restore_version = None
    scene.vm.restored_at = job.begun_at - dt.timedelta(days=1)  # an earlier life
    assert not _made_anew_under(job, scene.vm)
    scene.vm.restored_at = job.begun_at + dt.timedelta(minutes=1)
    assert _made_anew_under(job, scene.vm)
    waiting = make_job(scene.vm, scene.ann, "queued")
    assert not _made_anew_under(waiting, scene.vm)


def test_the_job_pass_asks_with_the_copy_it_had_before_the_job_ended(scene):
    """The pass ends the job through another copy of its row: the one it holds still
    says running, and the job is run again all the same."""
    job = make_job(scene.vm, scene.milo, "running")
    Job.objects.filter(pk=job.pk).update(
        state="lost", rerun_after_preemption=True, ended_at=timezone.now()
    )
    assert job.state == "running"
    again = jobs.run_again_after_preemption(job)
    assert again is not None and again.rerun_of_id == job.pk

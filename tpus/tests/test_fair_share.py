"""Fair share of a lab's pool: a kind's waiting jobs go in the order of their people's
recent use (chip-hours halved every half-life) divided by their shares, first come,
first served within one person; recent use is kept per person as usage counts ended
jobs, and placement still reads it in a constant number of queries."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tpus.models import FairShare, Job
from tpus.services import fair_share, scheduler, usage
from tpus.services.fair_share import decay, job_use
from tpus.services.scheduler import JobRow, Snapshot, VmRow
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job
from tpus.tests.test_pool_placement import pool_job, ready_vm

scene = jobs_support.scene


@pytest.fixture
def passes(monkeypatch):
    """The VM passes placement queues (the tasks are not run)."""
    queued = []
    monkeypatch.setattr(scheduler.queue, "advance_jobs", queued.append)
    return queued


HOUR = dt.timedelta(hours=1)
WEEK = dt.timedelta(days=7)
NOW = timezone.make_aware(dt.datetime(2026, 11, 28, 12))


# --- the arithmetic ------------------------------------------------------------------


def test_use_halves_every_half_life():
    assert decay(100.0, NOW, NOW, WEEK) == 100.0
    assert decay(100.0, NOW, NOW + WEEK, WEEK) == pytest.approx(50.0)
    assert decay(100.0, NOW, NOW + 3 * WEEK, WEEK) == pytest.approx(12.5)
    assert decay(100.0, NOW, NOW + 7 * HOUR, dt.timedelta(hours=7)) == pytest.approx(50.0)


def test_a_short_job_counts_its_chips_times_its_hours():
    assert job_use(4, NOW - HOUR, NOW, NOW, WEEK) == pytest.approx(4.0, rel=1e-2)
    # An hour that ended nine hours ago weighs about as its middle does, 9.5 hours ago.
    assert job_use(4, NOW - 10 * HOUR, NOW - 9 * HOUR, NOW, WEEK) == pytest.approx(
        4.0 * 2 ** (-9.5 / 168), rel=1e-5
    )


def test_a_jobs_use_a_half_life_later_is_half():
    now = job_use(8, NOW - 2 * WEEK, NOW, NOW, WEEK)
    later = job_use(8, NOW - 2 * WEEK, NOW, NOW + WEEK, WEEK)
    assert later == pytest.approx(now / 2)
    # Two weeks of 8 chips, the first hours weighing less: 8 × 168 / ln 2 × (1 − 1/4).
    assert now == pytest.approx(8 * 168 / 0.6931471805599453 * 0.75)


def test_a_running_job_counts_until_now_and_a_job_not_begun_counts_nothing():
    assert job_use(4, NOW - 2 * HOUR, None, NOW, WEEK) == pytest.approx(8.0, rel=1e-2)
    assert job_use(4, NOW, NOW - HOUR, NOW, WEEK) == 0.0


# --- the decision (pure) -------------------------------------------------------------


def snapshot(jobs, use=None, shares=None, vms=2):
    rows = [VmRow(n, f"tpu{n}", "v4-8", "us-central1-f", False, True, 4) for n in range(vms)]
    people = {job.user_id for job in jobs}
    grants = {(user, vm.id) for user in people for vm in rows}
    return Snapshot(1, 0, rows, jobs, grants, use=use or {}, shares=shares or {})


def job(pk, user, seq):
    return JobRow(pk, user, "v4-8", (), "any", seq)


def test_the_person_with_less_recent_use_goes_first_whoever_submitted_first():
    jobs = [job(1, user=10, seq=0), job(2, user=10, seq=1), job(3, user=20, seq=2)]
    placed = scheduler.decide(snapshot(jobs, use={10: 50.0, 20: 5.0}))
    assert [p.job_id for p in placed] == [3, 1]
    fifo = scheduler.decide(snapshot(jobs, use={10: 50.0}), order_key=scheduler.fifo)
    assert [p.job_id for p in fifo] == [1, 2]


def test_a_share_divides_recent_use():
    jobs = [job(1, user=10, seq=0), job(2, user=20, seq=1)]
    # 50 chip-hours for a share of 10 is 5 a share, under 20's 8.
    placed = scheduler.decide(snapshot(jobs, use={10: 50.0, 20: 8.0}, shares={10: 10.0}, vms=1))
    assert [p.job_id for p in placed] == [1]
    placed = scheduler.decide(snapshot(jobs, use={10: 50.0, 20: 8.0}, vms=1))
    assert [p.job_id for p in placed] == [2]


def test_one_persons_jobs_go_first_come_first_served():
    jobs = [job(3, user=10, seq=2), job(1, user=10, seq=0), job(2, user=10, seq=1)]
    placed = scheduler.decide(snapshot(jobs, use={10: 99.0}, vms=3))
    assert [p.job_id for p in placed] == [1, 2, 3]


def test_equals_are_served_in_the_order_they_submitted():
    jobs = [job(2, user=20, seq=1), job(1, user=10, seq=0)]
    placed = scheduler.decide(snapshot(jobs, use={10: 4.0, 20: 4.0}, vms=1))
    assert [p.job_id for p in placed] == [1]


# --- recent use, kept as usage counts ended jobs --------------------------------------


def test_counting_an_ended_job_adds_its_decayed_chip_hours_to_its_person_once(scene):
    now = timezone.now()
    make_job(scene.vm, scene.milo, "succeeded", started_at=now - 3 * HOUR, ended_at=now - HOUR)
    assert usage.count_ended_jobs() == 1
    row = FairShare.objects.get(lab=scene.lab, user=scene.milo)
    # tpu5 is a v4-8: 4 chips for 2 hours, an hour ago.
    assert row.use == pytest.approx(8.0, rel=1e-2)
    assert usage.count_ended_jobs() == 0
    again = FairShare.objects.get(lab=scene.lab, user=scene.milo)
    assert again.use == row.use


def test_a_rows_use_decays_before_more_is_added(scene):
    now = timezone.now()
    FairShare.objects.create(lab=scene.lab, user=scene.milo, use=80.0, decayed_at=now - WEEK)
    make_job(scene.vm, scene.milo, "succeeded", started_at=now - HOUR, ended_at=now)
    usage.count_ended_jobs()
    row = FairShare.objects.get(lab=scene.lab, user=scene.milo)
    assert row.use == pytest.approx(40.0 + 4.0, rel=1e-2)


def test_recent_use_follows_the_labs_half_life(scene):
    scene.lab.fair_share_half_life_days = Decimal("1")
    scene.lab.save()
    now = timezone.now()
    FairShare.objects.create(
        lab=scene.lab, user=scene.milo, use=80.0, decayed_at=now - 2 * 24 * HOUR
    )
    standing = fair_share.standings(scene.lab, [scene.milo.pk], now)[scene.milo.pk]
    assert standing.use == pytest.approx(20.0)


def test_a_recount_makes_recent_use_again_from_every_job(scene):
    now = timezone.now()
    make_job(scene.vm, scene.milo, "succeeded", started_at=now - 3 * HOUR, ended_at=now - HOUR)
    usage.count_ended_jobs()
    counted = FairShare.objects.get(user=scene.milo).use
    usage.recount_all()
    assert FairShare.objects.get(user=scene.milo).use == pytest.approx(counted, rel=1e-3)


def test_a_running_job_and_one_not_counted_yet_are_recent_use_too(scene, passes):
    scene.vm.delete()
    a = ready_vm(scene.lab, "a", [scene.milo, scene.ann])
    b = ready_vm(scene.lab, "b", [scene.milo, scene.ann])
    now = timezone.now()
    make_job(a, scene.ann, "running", started_at=now - 2 * HOUR)
    make_job(b, scene.milo, "succeeded", started_at=now - HOUR, ended_at=now)  # not counted
    standings = fair_share.standings(scene.lab, [scene.milo.pk, scene.ann.pk])
    assert standings[scene.ann.pk].use == pytest.approx(8.0, rel=1e-2)
    assert standings[scene.ann.pk].running_chips == 4
    assert standings[scene.milo.pk].use == pytest.approx(4.0, rel=1e-2)
    assert standings[scene.milo.pk].running_chips == 0


# --- placement, with the database ------------------------------------------------------


def test_a_later_job_of_someone_with_less_recent_use_is_placed_first(scene, passes):
    scene.vm.delete()
    vm = ready_vm(scene.lab, "a", [scene.milo, scene.ann])
    running = make_job(vm, scene.ann, "running")
    FairShare.objects.create(lab=scene.lab, user=scene.milo, use=100.0)
    heavy_first = pool_job(scene.milo, scene.lab)
    heavy_second = pool_job(scene.milo, scene.lab)
    light = pool_job(scene.ann, scene.lab)
    reasons = scheduler.why_they_wait(scene.lab.pk)
    assert reasons[light.pk] == "All 1 v4-8 you may use is busy; 0 jobs before yours."
    assert reasons[heavy_first.pk] == (
        "All 1 v4-8 you may use is busy; your recent use is above your share (100.0 "
        "chip-hours for a share of 1), so others' jobs go first; 1 job before yours."
    )
    # Behind their own earlier job only: nothing of others was put ahead of it.
    assert reasons[heavy_second.pk].endswith("so others' jobs go first; 2 jobs before yours.")
    Job.objects.filter(pk=running.pk).update(state="succeeded", ended_at=timezone.now())
    placed = scheduler.place(scene.lab.pk)
    assert [p.job_id for p in placed] == [light.pk]


def test_a_larger_share_lets_a_heavier_user_go_first(scene, passes):
    scene.vm.delete()
    vm = ready_vm(scene.lab, "a", [scene.milo, scene.ann])
    running = make_job(vm, scene.ann, "running", started_at=None)  # no use of its own
    FairShare.objects.create(lab=scene.lab, user=scene.milo, use=100.0, share=Decimal(50))
    FairShare.objects.create(lab=scene.lab, user=scene.ann, use=10.0)
    ann = pool_job(scene.ann, scene.lab)
    milo = pool_job(scene.milo, scene.lab)
    Job.objects.filter(pk=running.pk).update(state="succeeded", ended_at=timezone.now())
    placed = scheduler.place(scene.lab.pk)
    assert [p.job_id for p in placed] == [milo.pk]  # 100 / 50 = 2 a share, under 10
    assert ann.pk in scheduler.why_they_wait(scene.lab.pk)


def queries_of_a_load(lab, vms: int, jobs: int, users) -> int:
    for index in range(vms):
        vm = ready_vm(lab, f"n{vms}-{index}", users, accelerator_type=f"v{2 + index % 3}-8")
        make_job(vm, users[index % 2], "running")
        make_job(vm, users[index % 2], "succeeded")  # ended, not counted yet
    for user in users:
        FairShare.objects.update_or_create(lab=lab, user=user, defaults={"use": 3.0 * vms})
    for index in range(jobs):
        Job.objects.create(
            lab=lab,
            user=users[index % 2],
            accelerator_type=f"v{2 + index % 3}-8",
            host_id=f"q{vms}-{index}",
            args=["true"],
        )
    with CaptureQueriesContext(connection) as captured:
        snapshot = scheduler.load(lab.pk, every_vm=True)
    assert len(snapshot.jobs) == jobs and set(snapshot.use) == {u.pk for u in users}
    Job.objects.filter(lab=lab).delete()
    Job.objects.filter(vm__lab=lab).delete()
    from tpus.models import TpuVm

    TpuVm.objects.filter(lab=lab).delete()
    return len(captured)


def test_the_placements_snapshot_reads_as_many_queries_for_any_size(scene, passes):
    scene.lab.max_chips_per_person = 64
    scene.lab.save()
    users = [scene.milo, scene.ann]
    small = queries_of_a_load(scene.lab, 2, 3, users)
    large = queries_of_a_load(scene.lab, 30, 60, users)
    # Five for the placement, and the reasons' one look at the kinds' elastic pools.
    assert small == large <= 6


def test_the_migration_gives_everyone_the_recent_use_of_jobs_counted_before_it(scene):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("tpus.migrations.0042_fair_share_of_the_pool")
    now = timezone.now()
    make_job(scene.vm, scene.milo, "succeeded", started_at=now - 3 * HOUR, ended_at=now - HOUR)
    make_job(scene.vm, scene.ann, "succeeded", started_at=now - 90 * 24 * HOUR,
             ended_at=now - 89 * 24 * HOUR)  # fmt: skip
    usage.count_ended_jobs()
    expected = FairShare.objects.get(user=scene.milo).use
    FairShare.objects.all().delete()
    migration.recent_use_of_counted_jobs(apps, None)
    assert FairShare.objects.get(user=scene.milo).use == pytest.approx(expected, rel=1e-3)
    # Ended more than ten half-lives ago: under 0.1% of it would be left.
    assert not FairShare.objects.filter(user=scene.ann).exists()

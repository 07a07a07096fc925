"""Worker-hours from the per-day rows equal worker-hours summed job by job: for jobs
that cross midnight, that begin or end on a period's edge, that still run, on pods,
before and after the ended ones are counted into the rows."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from django.db.models import Count, F, Sum

from tpus.models import Grant, Job, UsageDay
from tpus.services import usage
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene

UTC = dt.UTC
NOW = dt.datetime(2026, 1, 20, 15, 30, 7, 250000, tzinfo=UTC)


def at(day: int, hour: int = 0, minute: int = 0, second: int = 0) -> dt.datetime:
    return dt.datetime(2026, 1, day, hour, minute, second, tzinfo=UTC)


# The computation the per-day rows replace: every job of the period, summed by the
# database, once per table.


def reference_jobs(lab, period, *, user=None, now=NOW):
    jobs = Job.objects.filter(vm__lab=lab)
    if user is not None:
        jobs = jobs.filter(user=user)
    return usage.worker_time(jobs, period, now)


def reference(lab, period, *, user=None, now=NOW) -> dict:
    jobs = reference_jobs(lab, period, user=user, now=now)
    totals = jobs.order_by().aggregate(jobs=Count("pk"), total=Sum("worker_time"))
    return {
        "totals": (totals["jobs"], totals["total"] or dt.timedelta()),
        "people": {
            row["user"]: (row["jobs"], row["total"])
            for row in jobs.values("user").annotate(jobs=Count("pk"), total=Sum("worker_time"))
        },
        "vms": {
            row["vm"]: (row["jobs"], row["total"])
            for row in jobs.values("vm").annotate(jobs=Count("pk"), total=Sum("worker_time"))
        },
        "pairs": {
            (row["user"], row["vm"]): (row["jobs"], row["total"])
            for row in jobs.values("user", "vm").annotate(
                jobs=Count("pk"), total=Sum("worker_time")
            )
        },
    }


def from_days(lab, period, *, user=None, now=NOW) -> dict:
    figures = usage.Usage(lab, period, user=user, now=now)
    summary = figures.summary()

    def plain(grouped):
        return {key: (f.jobs, f.total) for key, f in grouped.items()}

    return {
        "totals": (summary["jobs"], summary["total"]),
        "people": plain(figures.grouped("user")),
        "vms": plain(figures.grouped("vm")),
        "pairs": plain(figures.pairs()),
    }


@pytest.fixture
def seeded(scene, make_user, add_member):
    """Jobs around 10–12 January 2026 on a one-worker VM and a four-worker pod."""
    pod = make_vm(scene.lab, "pod1", workers=4)
    other = make_vm(scene.lab, "tpu9")
    cat = make_user("cat@vision.example")
    add_member(scene.lab, cat)
    for person in (scene.milo, scene.ann, cat):
        Grant.objects.create(user=person, vm=pod, state="active")
    vm, milo, ann = scene.vm, scene.milo, scene.ann
    ended = [
        # crosses one midnight, and the period's first edge
        (vm, milo, at(9, 22), at(10, 2)),
        # crosses two midnights, on the pod
        (pod, milo, at(10, 20), at(12, 3, 15)),
        # starts exactly at a period's first moment, ends exactly at midnight
        (vm, ann, at(10), at(11)),
        # ends exactly at the period's first moment: outside it
        (vm, ann, at(9, 23), at(10)),
        # inside one day, odd seconds and microseconds
        (pod, ann, at(11, 10, 0, 1), at(11, 10, 30, 2) + dt.timedelta(microseconds=7)),
        # a week long, across every period tried
        (other, cat, at(5, 12), at(19, 12)),
        # long before and long after
        (vm, cat, at(1, 1), at(1, 2)),
        (vm, cat, at(19, 1), at(19, 2)),
        # starts at the last moment of the period
        (pod, cat, at(11, 23, 59, 59), at(12, 0, 0, 1)),
    ]
    for target, person, started, end in ended:
        make_job(target, person, "succeeded", started_at=started, ended_at=end)
    # still running: counted until NOW
    make_job(pod, ann, "running", started_at=at(11, 20))
    make_job(other, milo, "running", started_at=at(20, 15))
    # ended in a state other than success, and never started
    make_job(vm, milo, "failed", started_at=at(11, 5), ended_at=at(11, 6))
    make_job(vm, ann, "rejected", queued_at=at(10, 5), started_at=None, ended_at=at(10, 5))
    make_job(vm, ann, "queued")
    return pod


PERIODS = [
    usage.Period(dt.date(2026, 1, 10), dt.date(2026, 1, 11)),
    usage.Period(dt.date(2026, 1, 10), dt.date(2026, 1, 10)),
    usage.Period(dt.date(2026, 1, 11), dt.date(2026, 1, 12)),
    usage.Period(dt.date(2026, 1, 12), dt.date(2026, 1, 12)),
    usage.Period(dt.date(2026, 1, 1), dt.date(2026, 1, 31)),
    usage.Period(dt.date(2026, 1, 20), dt.date(2026, 1, 20)),
    usage.Period(dt.date(2026, 1, 21), dt.date(2026, 1, 22)),  # after now
    usage.Period(dt.date(2025, 12, 1), dt.date(2025, 12, 31)),
]


def _compare(scene) -> None:
    for period, user in itertools.product(PERIODS, [None, scene.milo, scene.ann]):
        expected = reference(scene.lab, period, user=user)
        assert from_days(scene.lab, period, user=user) == expected, (period, user)


def test_figures_from_the_day_rows_equal_the_sum_over_every_job(scene, seeded):
    _compare(scene)  # nothing counted into the rows yet: every job is read
    assert reference(scene.lab, PERIODS[0])["totals"][0] == 8  # the seed is what it says
    assert usage.count_ended_jobs(limit=4) == 4  # some counted, some not
    assert UsageDay.objects.exists()
    _compare(scene)
    assert usage.count_all_ended_jobs() == 6
    assert not Job.objects.filter(usage_counted=False, ended_at__gt=F("started_at")).exists()
    _compare(scene)
    # Running jobs are never counted into the rows: they are read until they end.
    assert set(Job.objects.filter(usage_counted=False).values_list("state", flat=True)) == {
        "running",
        "rejected",
        "queued",
    }


def test_a_job_that_ends_later_is_counted_once_it_has_ended(scene, seeded):
    usage.count_all_ended_jobs()
    running = Job.objects.get(vm=seeded, state="running")
    Job.objects.filter(pk=running.pk).update(state="succeeded", ended_at=at(13, 4))
    _compare(scene)
    assert usage.count_ended_jobs() == 1
    _compare(scene)
    assert usage.count_ended_jobs() == 0  # never twice


def test_a_recount_gives_the_same_rows(scene, seeded):
    usage.count_all_ended_jobs()
    before = sorted(
        UsageDay.objects.values_list(
            "day", "user", "vm", "started", "carried", "worker_time", "chip_time"
        )
    )
    assert usage.recount_all() == 10
    after = sorted(
        UsageDay.objects.values_list(
            "day", "user", "vm", "started", "carried", "worker_time", "chip_time"
        )
    )
    assert before == after


def test_a_day_row_holds_the_part_of_a_job_inside_that_day(scene):
    pieces = usage.day_pieces(at(10, 20), at(12, 3, 15), 4)
    assert pieces == {
        dt.date(2026, 1, 10): (1, 0, dt.timedelta(hours=16)),
        dt.date(2026, 1, 11): (0, 1, dt.timedelta(hours=96)),
        dt.date(2026, 1, 12): (0, 1, dt.timedelta(hours=13)),
    }
    # Ending exactly at midnight makes no row for the day it ends on.
    assert usage.day_pieces(at(10), at(11), 1) == {
        dt.date(2026, 1, 10): (1, 0, dt.timedelta(days=1))
    }


def test_jobs_another_process_counted_meanwhile_are_not_added_twice(scene, seeded, monkeypatch):
    from django.db.models import QuerySet

    real_update = QuerySet.update
    raced = []

    def update(self, **values):
        if values == {"usage_counted": True} and not raced:
            # Between this run's read and its mark, another run counts a job it read.
            first = self.order_by("pk").first()
            raced.append(first.pk)
            real_update(Job.objects.filter(pk=first.pk), usage_counted=True)
        return real_update(self, **values)

    monkeypatch.setattr(QuerySet, "update", update)
    assert usage.count_ended_jobs() == 0  # this run gives way and adds nothing
    assert not UsageDay.objects.exists()
    # (Here the other run's mark was made in this run's transaction, and went with it.)
    monkeypatch.setattr(QuerySet, "update", real_update)
    assert usage.count_all_ended_jobs() == 10  # the next call counts each once
    assert UsageDay.objects.aggregate(n=Sum("started"))["n"] == 10
    _compare(scene)


def test_a_page_of_the_most_used_holds_what_ranking_everyone_would_put_there(scene, seeded):
    usage.count_ended_jobs(limit=5)  # some counted into the rows, some read one by one
    for period, user in itertools.product(PERIODS, [None, scene.ann]):
        figures = usage.Usage(scene.lab, period, user=user, now=NOW)
        summary = figures.summary()
        for key, count in (("user", summary["people"]), ("vm", summary["vms"])):
            everyone = usage.most_used_first(figures.grouped(key))
            assert count == len(everyone), (period, key)
            ranked = usage.MostUsedFirst(figures, key, count)
            for first, last in ((0, 1), (0, 2), (1, 2), (1, 3), (2, 4), (0, 10)):
                assert ranked[first:last] == everyone[first:last], (period, key, first, last)


def test_the_count_usage_command_counts_what_is_left_and_recounts_on_demand(scene, seeded):
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("count_usage", stdout=out)
    assert out.getvalue().strip() == "10 job(s) counted into the per-day usage rows."
    rows = sorted(UsageDay.objects.values_list("day", "user", "vm", "started", "worker_time"))
    out = StringIO()
    call_command("count_usage", "--recount", stdout=out)
    assert out.getvalue().startswith("10 job(s)")
    assert (
        sorted(UsageDay.objects.values_list("day", "user", "vm", "started", "worker_time")) == rows
    )
    _compare(scene)


def test_every_slice_of_a_crowd_ranked_in_the_database_is_what_ranking_everyone_gives(
    scene, make_user
):
    # Twenty people, each with ended jobs (counted into the rows) of various lengths,
    # equal totals among them (ties go to the smaller id), and six with a job running
    # now (read one by one), some of whom rise above people the rows rank before them.
    people = []
    for n in range(20):
        person = make_user(f"crowd{n}@vision.example")
        Grant.objects.create(user=person, vm=scene.vm, state="active")
        people.append(person)
        hours = [1, 3, 3, 5, 8][n % 5] + n // 5
        make_job(scene.vm, person, "succeeded", started_at=at(15, 1), ended_at=at(15, 1 + hours))
    usage.count_all_ended_jobs()
    for n, person in enumerate(people[::3]):
        vm = make_vm(scene.lab, f"run{n}")  # one running job per VM
        Grant.objects.create(user=person, vm=vm, state="active")
        make_job(vm, person, "running", started_at=NOW - dt.timedelta(hours=2 + 3 * n))
    figures = usage.Usage(
        scene.lab, usage.Period(dt.date(2026, 1, 1), dt.date(2026, 1, 31)), now=NOW
    )

    everyone = usage.most_used_first(figures.grouped("user"))
    assert figures.summary()["people"] == len(everyone) == 20
    ranked = usage.MostUsedFirst(figures, "user", len(everyone))
    for first in range(len(everyone) + 1):
        for size in (1, 2, 3, 5, 7, 20):
            assert ranked[first : first + size] == everyone[first : first + size], (first, size)


# --- chip-hours: a job's time × its VM's chips, as the pool's fair share counts it -----

H = dt.timedelta(hours=1)
TWO_DAYS = usage.Period(dt.date(2026, 1, 10), dt.date(2026, 1, 11))


def _chip_days(lab) -> dict:
    return {
        (row.day, row.vm.name): row.chip_time
        for row in UsageDay.objects.filter(lab=lab).select_related("vm")
    }


def _people_chip_hours(scene) -> dict:
    per_day = usage.Usage(scene.lab, TWO_DAYS, now=NOW).per_day("user", [scene.milo.pk], chips=True)
    return {day: sums.get(scene.milo.pk) for day, sums in per_day.items()}


def test_an_hour_on_a_v4_8_is_4_chip_hours_and_on_a_v4_32_16(scene):
    pod = make_vm(scene.lab, "pod1", workers=4)  # v4-32: 16 chips on 4 workers
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    make_job(scene.vm, scene.milo, "succeeded", started_at=at(10, 1), ended_at=at(10, 2))
    make_job(pod, scene.milo, "succeeded", started_at=at(11, 1), ended_at=at(11, 2))
    # Read from the jobs before they are counted, and from the rows after.
    assert _people_chip_hours(scene) == {dt.date(2026, 1, 10): 4 * H, dt.date(2026, 1, 11): 16 * H}
    usage.count_all_ended_jobs()
    assert _chip_days(scene.lab) == {
        (dt.date(2026, 1, 10), "tpu5"): 4 * H,
        (dt.date(2026, 1, 11), "pod1"): 16 * H,
    }
    assert UsageDay.objects.get(vm=pod).worker_time == 4 * H  # worker-hours stay as they were
    assert _people_chip_hours(scene) == {dt.date(2026, 1, 10): 4 * H, dt.date(2026, 1, 11): 16 * H}


def test_a_job_across_midnight_counts_its_chip_hours_on_each_day(scene):
    make_job(scene.vm, scene.milo, "succeeded", started_at=at(10, 22), ended_at=at(11, 1, 30))
    expected = {dt.date(2026, 1, 10): 8 * H, dt.date(2026, 1, 11): 6 * H}
    assert _people_chip_hours(scene) == expected
    usage.count_all_ended_jobs()
    assert _chip_days(scene.lab) == {
        (dt.date(2026, 1, 10), "tpu5"): 8 * H,
        (dt.date(2026, 1, 11), "tpu5"): 6 * H,
    }
    assert _people_chip_hours(scene) == expected


def test_a_running_job_counts_its_chip_hours_until_now(scene):
    pod = make_vm(scene.lab, "pod1", workers=4)
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    make_job(pod, scene.milo, "running", started_at=at(11, 22))
    make_job(scene.vm, scene.milo, "succeeded", started_at=at(11, 1), ended_at=at(11, 2))
    usage.count_all_ended_jobs()
    # Two hours of the 11th on 16 chips, read from the job, and one on 4 from the row.
    assert _people_chip_hours(scene) == {dt.date(2026, 1, 11): 36 * H}


def test_the_migration_gives_rows_counted_before_it_their_vms_chip_time(scene, monkeypatch):
    import importlib

    from django.apps import apps

    migration = importlib.import_module("tpus.migrations.0049_usage_days_count_chip_time")
    pod = make_vm(scene.lab, "pod1", workers=4)
    Grant.objects.create(user=scene.milo, vm=pod, state="active")
    make_job(scene.vm, scene.milo, "succeeded", started_at=at(10, 22), ended_at=at(11, 1, 30))
    make_job(pod, scene.milo, "succeeded", started_at=at(11, 1), ended_at=at(11, 2, 15))
    usage.count_all_ended_jobs()
    expected = _chip_days(scene.lab)
    UsageDay.objects.update(chip_time=dt.timedelta())
    monkeypatch.setattr(migration, "BATCH", 2)  # more rows than one batch
    migration.chip_time_of_counted_days(apps, None)
    assert (
        _chip_days(scene.lab)
        == expected
        == {
            (dt.date(2026, 1, 10), "tpu5"): 8 * H,
            (dt.date(2026, 1, 11), "tpu5"): 6 * H,
            (dt.date(2026, 1, 11), "pod1"): 20 * H,
        }
    )

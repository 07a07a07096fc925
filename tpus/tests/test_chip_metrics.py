"""Chip metrics without hosts: the status answer's metric lines parsed strictly and
bounded (a line that does not read refuses the worker's metrics, never its job
status), the ports checked before they are sent, a bounded history per chip, and the
new fields of the page and the API only for those who may see the VM."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.services import create_token
from portal.charts import bins
from tpus.models import ChipSample, TpuVm, VmDutyDay
from tpus.remote import jobs as wire
from tpus.services import chip_metrics
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

scene = jobs_support.scene
GIB = 1024**3
OK = ("metrics", "ok")
JAN_FIRST, JAN_LAST = dt.date(2026, 1, 1), dt.date(2026, 1, 31)


def chip(text: str) -> tuple[str, str]:
    return ("chip", text)


@pytest.mark.parametrize(
    "lines",
    [
        [chip("0 used=1 total=2 duty=3")],  # no metrics line first
        [("metrics", "maybe")],
        [("metrics", "none <b>bold</b>")],
        [OK],  # ok without a chip
        [OK, chip("0 used=3 total=2 duty=50")],  # more used than there is
        [OK, chip("0 used=1 total=2 duty=100.5")],
        [OK, chip("0 used=1 total=2 duty=101")],
        [OK, chip("0 used=1 total=2 duty=-1")],
        [OK, chip("0 used=-1 total=2 duty=1")],
        [OK, chip("64 used=1 total=2 duty=1")],  # past the most chips a worker has
        [OK, chip(f"0 used=1 total={2**51} duty=1")],  # past 1 PiB
        [OK, chip("0 used=1 total=2 duty=1 extra=1")],
        [OK, chip("0 used=1 total=2 duty=1.234")],
        [OK, chip("0 used=1 total=2 duty=1"), chip("0 used=1 total=2 duty=1")],  # twice
        [OK, *[chip(f"{n} used=1 total=2 duty=1") for n in range(65)]],
        [("metrics", "none nothing listens"), chip("0 used=1 total=2 duty=1")],
        [OK, ("metrics", "ok"), chip("0 used=1 total=2 duty=1")],
    ],
)
def test_malformed_metric_lines_are_refused_whole(lines):
    with pytest.raises(ValueError):
        wire.parse_metrics(lines)


def test_metric_lines_that_do_not_read_leave_the_job_status_as_it_was():
    pairs = [
        ("boot_id", "b1"),
        ("job", "j1 running pid=42 boot_id=b1 started_at=1.5 ended_at=- exit=- signal=- "
                "cancel=0 process=alive log_size=7"),
        ("lock", "held j1"),
        OK,
        chip("0 used=9 total=2 duty=1"),
    ]  # fmt: skip
    report = wire.parse_status(pairs)
    assert report.jobs["j1"].state == "running" and report.lock_holder == "j1"
    assert report.metrics == wire.WorkerMetrics(none="unreadable")
    assert "out of bounds" in report.metrics_error


def test_well_formed_metric_lines_give_each_chip():
    report = wire.parse_status(
        [("boot_id", "b"), ("lock", "free"), OK, chip(f"0 used={GIB} total={2 * GIB} duty=85.5"),
         chip("1 used=0 total=16 duty=0")]
    )  # fmt: skip
    assert report.metrics.chips == [
        wire.ChipMetrics(0, GIB, 2 * GIB, 85.5),
        wire.ChipMetrics(1, 0, 16, 0.0),
    ]
    none = wire.parse_status([("lock", "free"), ("metrics", "none the worker has no python3")])
    assert none.metrics == wire.WorkerMetrics(none="the worker has no python3")
    assert wire.parse_status([("lock", "free")]).metrics is None  # not asked


@pytest.mark.parametrize(
    "ports",
    [(), (8431, 8431), tuple(range(9000, 9009)), (80,), (70000,), ("8431",), (True,), "8431"],
)
def test_metrics_ports_are_checked_before_they_are_sent(ports):
    with pytest.raises(ValueError):
        wire.encode_status({}, metrics_ports=ports or [0])
    with pytest.raises(ValueError):
        wire.encode_start(wire.StartJob("j1", "milo", ("true",), metrics_ports=ports or [0]))


def test_a_job_cannot_set_the_metrics_ports_itself():
    with pytest.raises(ValueError, match="set by the portal"):
        wire.encode_start(
            wire.StartJob("j1", "milo", ("true",), env=(("TPU_RUNTIME_METRICS_PORTS", "1"),))
        )


def test_the_ports_travel_in_the_start_and_the_status_input():
    start = wire.encode_start(wire.StartJob("j1", "milo", ("true",), metrics_ports=(8431, 8432)))
    assert b"\nmetrics_ports 8431,8432\nend\n" in start
    assert b"\nmetrics 8431\nend\n" in wire.encode_status({}, metrics_ports=[8431])


# --- the history -------------------------------------------------------------------


def _answer(used: int) -> dict:
    return {0: wire.WorkerMetrics([wire.ChipMetrics(0, used, 32 * GIB, 50.0),
                                   wire.ChipMetrics(1, used, 32 * GIB, 60.0)]),
            1: None}  # fmt: skip


@pytest.mark.django_db
def test_each_chip_keeps_a_bounded_history_written_at_most_once_per_interval(scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 12
    settings.PORTAL_JOB_POLL_SECONDS = 4
    settings.PORTAL_CHIP_METRICS_KEEP_MINUTES = 1
    start = timezone.now() - dt.timedelta(minutes=3)
    # A pass every 2 s for 3 minutes: the page's figures follow every one, the history
    # takes one sample per chip per 10 s (12 s less half a poll) and keeps the last
    # minute of them.
    for step in range(90):
        chip_metrics.record(scene.vm, _answer(step), now=start + dt.timedelta(seconds=2 * step))
    vm = TpuVm.objects.get(pk=scene.vm.pk)
    assert vm.chip_metrics[0]["chips"][0]["used"] == 89
    assert vm.chip_metrics[1] == {"worker": 1, "chips": [], "none": chip_metrics.NO_ANSWER}
    history = chip_metrics.history(vm)
    assert set(history) == {(0, 0), (0, 1)}
    for samples in history.values():
        assert 5 <= len(samples) <= 6
        assert all(
            b.at - a.at >= dt.timedelta(seconds=10)
            for a, b in zip(samples, samples[1:], strict=False)
        )


@pytest.mark.django_db
def test_no_ports_configured_means_nothing_is_asked_or_kept(scene, settings):
    settings.PORTAL_CHIP_METRICS_PORTS = []
    assert b"metrics" not in wire.encode_status({}, metrics_ports=chip_metrics.ports())
    chip_metrics.record(scene.vm, _answer(1))
    assert TpuVm.objects.get(pk=scene.vm.pk).chip_metrics == []
    assert not ChipSample.objects.exists()


@pytest.mark.django_db
def test_samples_past_the_window_go_even_when_no_chip_is_read_any_more(scene, settings):
    settings.PORTAL_CHIP_METRICS_KEEP_MINUTES = 1
    start = timezone.now() - dt.timedelta(minutes=5)
    chip_metrics.record(scene.vm, _answer(GIB), now=start)
    assert ChipSample.objects.count() == 2
    assert chip_metrics.duty_means([scene.vm.pk]) == {}  # older than the window
    none = {0: wire.WorkerMetrics(none="nothing listens on port(s) 8431")}
    chip_metrics.record(scene.vm, none, now=start + dt.timedelta(minutes=2))
    assert not ChipSample.objects.exists()


@pytest.mark.django_db
def test_a_vm_is_asked_for_metrics_again_only_once_the_interval_has_passed(scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    vm = scene.vm
    assert chip_metrics.ports_to_ask(vm) == (8431, 8432, 8433, 8434)  # never read
    read = timezone.now()
    chip_metrics.record(vm, _answer(1), now=read)
    assert chip_metrics.ports_to_ask(vm, now=read + dt.timedelta(seconds=5)) == ()
    # The poll on the beat after the interval asks, even a little early.
    assert chip_metrics.ports_to_ask(vm, now=read + dt.timedelta(seconds=9)) != ()
    vm = TpuVm.objects.get(pk=vm.pk)
    assert chip_metrics.ports_to_ask(vm, now=read + dt.timedelta(seconds=1)) == ()


@pytest.mark.django_db
def test_each_chips_mean_duty_over_the_kept_samples_is_on_the_page(client, scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    start = timezone.now()
    for step, duty in enumerate((20.0, 80.0, 35.0)):
        answer = {0: wire.WorkerMetrics([wire.ChipMetrics(0, GIB, 32 * GIB, duty)])}
        chip_metrics.record(scene.vm, answer, now=start + dt.timedelta(seconds=10 * step))
    assert chip_metrics.duty_means([scene.vm.pk]) == {(scene.vm.pk, 0, 0): 45.0}
    client.force_login(scene.milo)
    page = client.get(reverse("vm_jobs", args=["vision", scene.vm.pk])).content.decode()
    assert "<td>35%</td><td>45%</td>" in page


# --- who sees them -----------------------------------------------------------------


@pytest.fixture
def measured(scene, cast):
    """tpu5 with milo's job running and its chips read; tpu6 of the same lab, read too,
    on which milo holds no grant."""
    job = make_job(scene.vm, scene.milo, "running", started_at=timezone.now())
    chip_metrics.record(scene.vm, _answer(12 * GIB))
    other = make_vm(cast.lab, "tpu6")
    chip_metrics.record(other, {0: wire.WorkerMetrics(none="nothing listens on port(s) 8431")})
    return job, other


def _api(client, user, path):
    token = create_token(user, "t")[1]
    return client.get(f"/api/v1{path}", HTTP_AUTHORIZATION=f"Bearer {token}")


@pytest.mark.django_db
def test_members_see_the_chips_of_the_vms_they_may_see_and_no_others(client, scene, measured):
    job, other = measured
    rows = _api(client, scene.milo, "/labs/vision/usage/now").json()["items"]
    assert [r["vm"] for r in rows] == ["tpu5"]
    chips = rows[0]["chips"]
    assert chips["summary"] == {
        "chips": 2, "hbm_used_bytes": 24 * GIB, "hbm_total_bytes": 64 * GIB,
        "duty_cycle_percent": 55.0,
    }  # fmt: skip
    assert chips["workers"][0]["chips"][0]["holder"] == f"job {job.pk} of milo"
    assert chips["workers"][0]["chips"][0]["duty_cycle_percent_mean"] == 50.0
    assert chips["workers"][1] == {"worker": 1, "none": chip_metrics.NO_ANSWER, "chips": []}

    admin_rows = _api(client, scene.admin, "/labs/vision/usage/now").json()["items"]
    assert {r["vm"]: r["chips"]["summary"] is None for r in admin_rows} == {
        "tpu5": False,
        "tpu6": True,
    }


@pytest.mark.django_db
def test_another_labs_people_get_a_404_for_the_chips_of_this_labs_vms(
    client, scene, cast, measured
):
    assert _api(client, cast.outsider, "/labs/vision/usage/now").status_code == 404
    assert _api(client, cast.outsider, f"/labs/vision/vms/{scene.vm.pk}").status_code == 404
    assert _api(client, cast.outsider, f"/labs/other/vms/{scene.vm.pk}").status_code == 404
    # A member who is not the lab's admin has no VM object to read at all.
    assert _api(client, scene.milo, f"/labs/vision/vms/{scene.vm.pk}").status_code in (403, 404)
    detail = _api(client, scene.admin, f"/labs/vision/vms/{scene.vm.pk}").json()
    assert detail["chips"]["summary"]["hbm_used_bytes"] == 24 * GIB


@pytest.mark.django_db
def test_the_vm_page_shows_each_workers_chips_live(client, scene, measured):
    job, other = measured
    client.force_login(scene.milo)
    page = client.get(reverse("vm_jobs", args=["vision", scene.vm.pk])).content.decode()
    table = page[
        page.index('id="chip-metrics"') : page.index("</table>", page.index("chip-metrics"))
    ]
    assert "12.0 of 32.0 GiB" in table and "50%" in table and "60%" in table
    assert f"job {job.pk} of milo" in table
    assert f"No metrics: {chip_metrics.NO_ANSWER}" in table

    client.force_login(scene.admin)
    page = client.get(reverse("vm_detail", args=["vision", other.pk])).content.decode()
    assert "No metrics: nothing listens on port(s) 8431" in page


@pytest.mark.django_db
def test_a_chip_held_outside_the_portal_names_its_process(client, scene):
    TpuVm.objects.filter(pk=scene.vm.pk).update(
        outside_holders=[{"worker": 0, "device": "/dev/accel1", "pid": "77", "user": "eve",
                          "command": "python nb.py"}]
    )  # fmt: skip
    vm = TpuVm.objects.get(pk=scene.vm.pk)
    chip_metrics.record(vm, _answer(GIB))
    vm.refresh_from_db()
    [worker, _] = chip_metrics.workers_now(vm)
    assert [c.holder for c in worker.chips] == ["", "eve (pid 77)"]


# --- the day rows --------------------------------------------------------------------


def _duty(duty: float, chips: int = 2) -> dict:
    return {0: wire.WorkerMetrics([wire.ChipMetrics(n, GIB, 32 * GIB, duty)
                                   for n in range(chips)])}  # fmt: skip


def _days(vm) -> dict[dt.date, tuple[float, float]]:
    return {row.day: (row.observed, row.duty) for row in VmDutyDay.objects.filter(vm=vm)}


@pytest.mark.django_db
def test_each_reading_adds_the_time_since_the_last_at_the_chips_mean_duty(scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    noon = timezone.make_aware(dt.datetime(2026, 1, 10, 12))
    chip_metrics.record(scene.vm, _duty(20.0), now=noon)  # the first: no interval yet
    assert _days(scene.vm) == {}
    # Two chips at 40 % and 60 %: 10 s observed at 50 %, 5 duty-seconds.
    answer = {0: wire.WorkerMetrics([wire.ChipMetrics(0, GIB, 32 * GIB, 40.0),
                                     wire.ChipMetrics(1, 8 * GIB, 32 * GIB, 60.0)])}  # fmt: skip
    chip_metrics.record(scene.vm, answer, now=noon + dt.timedelta(seconds=10))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (10.0, 5.0)}
    chip_metrics.record(scene.vm, _duty(100.0), now=noon + dt.timedelta(seconds=20))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (20.0, 15.0)}
    assert VmDutyDay.objects.get(vm=scene.vm).hbm_peak == 0.25
    days = chip_metrics.duty_days(scene.lab, [scene.vm.pk], bins(JAN_FIRST, JAN_LAST))
    assert days == {scene.vm.pk: {dt.date(2026, 1, 10): chip_metrics.DutyDay(20.0, 15.0)}}


@pytest.mark.django_db
def test_a_gap_between_readings_longer_than_the_cap_is_not_counted_as_observed(scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    noon = timezone.make_aware(dt.datetime(2026, 1, 10, 12))
    chip_metrics.record(scene.vm, _duty(50.0), now=noon)
    # An hour without a reading: only the 20 s before the next one (twice the interval).
    chip_metrics.record(scene.vm, _duty(50.0), now=noon + dt.timedelta(hours=1))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (20.0, 10.0)}
    # Workers that did not answer add nothing, and the interval after them is their own.
    chip_metrics.record(scene.vm, {0: None}, now=noon + dt.timedelta(hours=1, seconds=10))
    chip_metrics.record(scene.vm, _duty(50.0), now=noon + dt.timedelta(hours=1, seconds=20))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (30.0, 15.0)}


@pytest.mark.django_db
def test_an_interval_across_midnight_in_the_portals_time_zone_is_split_between_its_days(
    scene, settings
):
    import zoneinfo

    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    with timezone.override(zoneinfo.ZoneInfo("America/New_York")):
        # 23:59:54 in New York is 04:59:54 UTC on the next day.
        before = timezone.make_aware(dt.datetime(2026, 1, 10, 23, 59, 54))
        chip_metrics.record(scene.vm, _duty(50.0), now=before)
        chip_metrics.record(scene.vm, _duty(50.0), now=before + dt.timedelta(seconds=10))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (6.0, 3.0), dt.date(2026, 1, 11): (4.0, 2.0)}


@pytest.mark.django_db
def test_a_reading_folds_into_its_day_in_one_query_whatever_the_number_of_chips(
    scene, settings, django_assert_num_queries
):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    noon = timezone.make_aware(dt.datetime(2026, 1, 10, 12))
    chip_metrics.record(scene.vm, _duty(50.0), now=noon)
    chip_metrics.record(scene.vm, _duty(50.0), now=noon + dt.timedelta(seconds=10))
    # The VM's last answer, the old samples, whether one is recent, the samples, the day.
    for step, chips in enumerate((1, 8), start=2):
        later = noon + dt.timedelta(seconds=10 * step)
        with django_assert_num_queries(5):
            chip_metrics.record(scene.vm, _duty(50.0, chips), now=later)
    assert _days(scene.vm)[dt.date(2026, 1, 10)][0] == 30.0


@pytest.mark.django_db
def test_a_reading_after_another_stored_meanwhile_is_not_counted_twice(scene, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    settings.PORTAL_JOB_POLL_SECONDS = 5
    noon = timezone.make_aware(dt.datetime(2026, 1, 10, 12))
    chip_metrics.record(scene.vm, _duty(50.0), now=noon)
    stale = TpuVm.objects.get(pk=scene.vm.pk)
    chip_metrics.record(scene.vm, _duty(50.0), now=noon + dt.timedelta(seconds=10))
    chip_metrics.record(stale, _duty(50.0), now=noon + dt.timedelta(seconds=12))
    assert _days(scene.vm) == {dt.date(2026, 1, 10): (10.0, 5.0)}
    assert TpuVm.objects.get(pk=scene.vm.pk).chip_metrics_at == noon + dt.timedelta(seconds=12)


@pytest.mark.django_db
def test_a_long_periods_day_rows_are_summed_a_week_a_bar_in_the_database(scene):
    for day, observed, busy in ((1, 100.0, 90.0), (4, 300.0, 30.0), (9, 50.0, 5.0), (9, 0, 0)):
        vm = scene.vm if observed else make_vm(scene.lab, "tpu6")
        VmDutyDay.objects.create(vm=vm, day=dt.date(2026, 1, day), observed=observed, duty=busy)
    year = bins(JAN_FIRST, dt.date(2026, 12, 31))
    vms = VmDutyDay.objects.values_list("vm", flat=True)
    assert chip_metrics.duty_days(scene.lab, vms, year) == {
        scene.vm.pk: {
            JAN_FIRST: chip_metrics.DutyDay(400.0, 120.0),
            dt.date(2026, 1, 8): chip_metrics.DutyDay(50.0, 5.0),
        }
    }

"""The usage page's charts: chip-hours per person per day, the time a portal job held
each TPU VM, and how long jobs waited to start. Their shapes add up to the figures of
the tables under them, they show one's own jobs only to a member, and they cost a
fixed number of queries."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from portal.charts import Bin, bins
from tpus.models import Grant, TpuVm
from tpus.services import chip_metrics, usage, usage_charts
from tpus.services.chip_metrics import DutyDay
from tpus.services.usage_charts import HELD_SERIES, held_chart, people_chart, wait_chart
from tpus.tests import jobs_support, test_jobs_usage
from tpus.tests.jobs_support import account, make_job, make_vm
from tpus.tests.test_jobs_usage import PERIOD, at

pytestmark = pytest.mark.django_db
scene = jobs_support.scene
history = test_jobs_usage.history

H = dt.timedelta(hours=1)
HELD, DUTY = HELD_SERIES
JAN = [dt.date(2026, 1, d) for d in range(1, 32)]


def _week() -> list[Bin]:
    return bins(JAN[0], JAN[6])


def _stacks(chart) -> dict[int, list]:
    """The chart's rectangles by the bar they stand in (by their middle)."""
    found: dict[float, list] = {}
    for rect in chart.rects:
        found.setdefault(round(rect.x + rect.width / 2, 3), []).append(rect)
    return {n: found[x] for n, x in enumerate(sorted(found))}


# --- the shapes ------------------------------------------------------------------------


def test_each_stacked_bar_adds_up_to_the_total_in_its_tables_row():
    per_day = {
        JAN[0]: {None: 7 * H, 1: 4 * H, 2: 2 * H},
        JAN[2]: {None: 30 * H, 1: 30 * H},
        JAN[3]: {None: 1.5 * H, 2: 0.25 * H},
    }
    chart = people_chart(_week(), [(1, "ann"), (2, "milo")], per_day, everyone=True)
    assert chart.head == ["Day", "ann", "milo", "Everyone else", "Total"]
    rows = {row[0]: row[1:] for row in chart.rows}
    assert rows["1 Jan 2026"] == ["4.00", "2.00", "1.00", "7.00"]
    assert rows["3 Jan 2026"] == ["30.00", "0.00", "0.00", "30.00"]
    assert rows["4 Jan 2026"] == ["0.00", "0.25", "1.25", "1.50"]
    stacks = _stacks(chart)
    used = [row for row in chart.rows if row[-1] != "0.00"]
    assert len(stacks) == len(used) == 3
    for stack, row in zip(stacks.values(), used, strict=True):
        assert f"{sum(r.value for r in stack):.2f}" == row[-1]
        for rect in stack:
            assert f"{rect.value:.2f}" == row[1 + rect.series]
    # Heights are to one scale: the 30-hour bar is twenty times the 1.5-hour one.
    height = {n: sum(r.height for r in stack) for n, stack in stacks.items()}
    assert height[1] == pytest.approx(20 * height[2])


def test_a_day_with_no_use_has_no_bar_and_zeros_in_the_table():
    chart = people_chart(_week(), [(1, "ann")], {JAN[1]: {None: 3 * H, 1: 3 * H}}, everyone=True)
    assert len(chart.rects) == 1
    assert [row for row in chart.rows if row[0] == "5 Jan 2026"] == [["5 Jan 2026", "0.00", "0.00"]]
    empty = people_chart(_week(), [], {}, everyone=True)
    assert empty.rects == [] and empty.head == ["Day", "Total"]
    assert all(row[1:] == ["0.00"] for row in empty.rows) and len(empty.rows) == 7
    assert "No job ran" in empty.description


def test_one_person_is_one_series_without_everyone_else():
    chart = people_chart(_week(), [(1, "milo")], {JAN[0]: {None: 2 * H, 1: 2 * H}}, everyone=False)
    assert [s.label for s in chart.series] == ["milo"]
    assert chart.head == ["Day", "milo", "Total"]


def test_people_after_the_first_ones_are_summed_as_everyone_else():
    per_day = {JAN[0]: {None: sum((n * H for n in range(1, 9)), dt.timedelta())}}
    for n in range(1, 9):
        per_day[JAN[0]][n] = n * H
    top = [(n, f"p{n}") for n in range(8, 3, -1)]  # the five who used the most
    chart = people_chart(_week(), top, per_day, everyone=True)
    assert [s.label for s in chart.series] == ["p8", "p7", "p6", "p5", "p4", "Everyone else"]
    assert chart.rows[0] == ["1 Jan 2026", "8.00", "7.00", "6.00", "5.00", "4.00", "6.00", "36.00"]
    # Each series its own colour and its own pattern.
    assert len({(s.colour, s.pattern) for s in chart.series}) == 6
    assert len({s.pattern for s in chart.series}) == 6


def test_a_long_period_is_drawn_a_week_a_bar():
    assert len(bins(JAN[0], JAN[0] + dt.timedelta(days=61))) == 62
    year = bins(dt.date(2026, 1, 1), dt.date(2026, 12, 31))
    assert len(year) == 53 and year[0] == Bin(dt.date(2026, 1, 1), dt.date(2026, 1, 7))
    assert year[-1] == Bin(dt.date(2026, 12, 31), dt.date(2026, 12, 31))
    chart = people_chart(year, [(1, "ann")], {dt.date(2026, 1, 3): {None: H, 1: H}}, everyone=True)
    assert chart.head[0] == "Week" and chart.rows[0][0] == "1 Jan – 7 Jan 2026"
    assert chart.rows[0][1:] == ["1.00", "1.00"]


def test_time_held_is_a_jobs_worker_time_over_the_vms_workers_and_the_time_passed():
    days = bins(JAN[0], JAN[2])
    now = dt.datetime(2026, 1, 3, 12, tzinfo=dt.UTC)  # half of the third day has passed
    lengths = usage_charts.day_lengths(days, now)
    assert lengths[JAN[2]] == 12 * H and lengths[JAN[0]] == 24 * H
    per_day = {JAN[0]: {7: 48 * H, 8: 6 * H}, JAN[2]: {7: 24 * H}}
    chart = held_chart(days, [(7, "pod"), (8, "tpu5")], per_day, {7: 4, 8: 1}, lengths)
    assert chart.head == [
        "TPU VM", "Figure", "Whole period", "1 Jan 2026", "2 Jan 2026", "3 Jan 2026",
    ]  # fmt: skip
    # pod: 12 h of 24, none, 6 h of the 12 so far; 18 h of 60 over the period.
    assert chart.rows == [
        ["pod", HELD, "30 %", "50 %", "0 %", "50 %"],
        ["pod", DUTY, "no reading", "no reading", "no reading", "no reading"],
        ["tpu5", HELD, "10 %", "25 %", "0 %", "0 %"],
        ["tpu5", DUTY, "no reading", "no reading", "no reading", "no reading"],
    ]
    assert sorted(round(r.value, 2) for r in chart.rects) == [0.25, 0.5, 0.5]
    assert [s.label for s in chart.series] == [HELD, DUTY]
    assert "no reading" in chart.note and "outside the portal" in chart.note


def test_the_duty_cycle_is_the_mean_over_the_time_observed_beside_the_time_held():
    days = bins(JAN[0], JAN[2])
    lengths = usage_charts.day_lengths(days, dt.datetime(2026, 1, 4, tzinfo=dt.UTC))
    duty = {
        7: {JAN[0]: DutyDay(3600.0, 1800.0), JAN[2]: DutyDay(600.0, 0.0)},
        9: {JAN[1]: DutyDay(100.0, 100.0)},  # not a VM of the chart
    }
    per_day = {JAN[0]: {7: 12 * H}}
    chart = held_chart(days, [(7, "pod"), (8, "tpu5")], per_day, {7: 1, 8: 1}, lengths, duty)
    # pod: 50 % of the hour read on the 1st, nothing read on the 2nd, idle chips on the
    # 3rd; over the period 1,800 of 4,200 s. tpu5 was never read.
    assert chart.rows == [
        ["pod", HELD, "17 %", "50 %", "0 %", "0 %"],
        ["pod", DUTY, "43 %", "50 %", "no reading", "0 %"],
        ["tpu5", HELD, "0 %", "0 %", "0 %", "0 %"],
        ["tpu5", DUTY, "no reading", "no reading", "no reading", "no reading"],
    ]
    # In pod's row, the 1st's two bars side by side, each half of the slot's 80 %.
    slot = (360 - usage_charts.NAMES - 20) / 3
    held, busy = sorted(chart.rects, key=lambda r: r.x)
    assert (held.series, busy.series) == (0, 1)
    assert held.width == busy.width == pytest.approx(slot * 0.4)
    assert held.x == pytest.approx(usage_charts.NAMES + slot * 0.1)
    assert busy.x == pytest.approx(held.x + held.width)
    assert held.height == busy.height == pytest.approx(0.5 * (usage_charts.ROW - 6))
    assert held.y + held.height == busy.y + busy.height  # on one base line
    assert "pod over the period: time held 17 %, duty cycle (mean while observed) 43 %" in (
        chart.description
    )
    assert "tpu5 over the period: time held 0 %, duty cycle (mean while observed) no reading" in (
        chart.description
    )


def test_a_week_bar_of_duty_cycle_is_the_mean_over_the_time_read_in_that_week():
    year = bins(JAN[0], dt.date(2026, 12, 31))
    lengths = usage_charts.day_lengths(year, dt.datetime(2027, 1, 1, tzinfo=dt.UTC))
    duty = {7: {JAN[0]: DutyDay(100.0, 90.0), JAN[3]: DutyDay(300.0, 30.0)}}
    chart = held_chart(year, [(7, "pod")], {}, {7: 1}, lengths, duty)
    assert chart.rows[1][:5] == ["pod", DUTY, "30 %", "30 %", "no reading"]


def test_the_day_the_clocks_go_forward_is_23_hours_long():
    import zoneinfo

    from django.utils import timezone

    days = bins(dt.date(2026, 3, 28), dt.date(2026, 3, 30))
    with timezone.override(zoneinfo.ZoneInfo("Europe/Berlin")):
        lengths = usage_charts.day_lengths(days, dt.datetime(2026, 4, 1, tzinfo=dt.UTC))
    assert [lengths[b.first] for b in days] == [24 * H, 23 * H, 24 * H]


def test_a_day_that_has_not_begun_is_no_bar_and_a_dash():
    days = bins(JAN[0], JAN[1])
    lengths = usage_charts.day_lengths(days, dt.datetime(2026, 1, 1, 6, tzinfo=dt.UTC))
    chart = held_chart(days, [(7, "pod")], {JAN[0]: {7: 3 * H}}, {7: 1}, lengths)
    assert chart.rows[0] == ["pod", HELD, "50 %", "50 %", "–"]


def _waits(*seconds) -> usage.Waits:
    found = usage.Waits()
    for wait in seconds:
        found.add(wait)
    return found


def test_the_wait_chart_stacks_each_days_jobs_by_how_long_they_waited():
    waits = {JAN[0]: _waits(59, 60, 120, 1200, 4 * 3600), JAN[3]: _waits(30), JAN[4]: _waits()}
    chart = wait_chart(_week(), waits)
    assert chart.head == [
        "Day", "Jobs started", "Waited under 1 min", "Waited 1–10 min", "Waited 10 min–1 h",
        "Waited 1–6 h", "Waited 6 h or more", "Longest wait",
    ]  # fmt: skip
    rows = {row[0]: row[1:] for row in chart.rows}
    assert rows["1 Jan 2026"] == ["5", "1", "2", "1", "1", "0", "4 h"]
    assert rows["4 Jan 2026"] == ["1", "1", "0", "0", "0", "0", "30 s"]
    assert rows["2 Jan 2026"] == rows["5 Jan 2026"] == ["0", "0", "0", "0", "0", "0", "–"]
    stacks = _stacks(chart)
    assert [sorted((r.series, r.value) for r in stack) for stack in stacks.values()] == [
        [(0, 1), (1, 2), (2, 1), (3, 1)],
        [(0, 1)],
    ]
    # Counted jobs: the axis steps by whole jobs.
    assert [t.text for t in chart.texts if t.anchor == "end"] == ["0", "2", "4", "6"]
    assert "4 h" in chart.description and "2 waited 1–10 min" in chart.description


def test_every_text_in_the_drawing_is_escaped_and_it_is_named_by_its_title():
    name = '<script>alert("x")</script>&'
    chart = people_chart(_week(), [(1, name)], {JAN[0]: {None: H, 1: H}}, everyone=False)
    svg = str(chart.svg)
    assert "<script>" not in svg and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in svg
    assert svg.startswith('<svg class="chart" role="img" viewBox="0 0 360 ')
    assert 'aria-labelledby="chart-people-title chart-people-desc"' in svg
    assert '<title id="chart-people-title">' in svg and '<desc id="chart-people-desc">' in svg
    assert 'fill="url(#chart-people-s0)"' in svg and '<pattern id="chart-people-s0"' in svg
    table = str(chart.table)
    assert "<script>" not in table
    assert '<th scope="col">&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;</th>' in table


# --- the page --------------------------------------------------------------------------


def _usage(client, query=PERIOD):
    return client.get(reverse("lab_usage", args=["vision"]) + query).content.decode()


def _chart_table(body: str, chart_id: str) -> list[list[str]]:
    part = body[body.index(f'id="{chart_id}-table"') :]
    part = part[: part.index("</table>")]
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", part, re.S)[1:]:
        cells = re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)
        rows.append([" ".join(re.sub(r"<[^>]+>", " ", c).split()) for c in cells])
    return rows


@pytest.mark.parametrize("counted", [False, True])
def test_the_page_shows_the_three_charts_with_their_tables(client, scene, history, counted):
    if counted:
        usage.count_all_ended_jobs()  # the same figures from the per-day rows
    client.force_login(scene.admin)
    body = _usage(client)
    assert body.count('<svg class="chart" role="img"') == 3
    for chart in ("chart-people", "chart-held", "chart-waits"):
        assert f'<section class="card chart-card" id="{chart}"' in body
        assert f'<table id="{chart}-table">' in body
    # Chip-hours: ann ran 0.5 h on tpu5 (a v4-8, 4 chips) on the 10th and a running
    # job on pod1 (a v4-32, 16 chips) 4 h on the 11th; milo 2 h on tpu5 on the 10th
    # and 1 h on pod1 on the 11th. The page's total stays 22.50 worker-hours.
    assert _chart_table(body, "chart-people") == [
        ["10 Jan 2026", "2.00", "8.00", "10.00"],
        ["11 Jan 2026", "64.00", "16.00", "80.00"],
    ]
    head = body.split('id="chart-people-table"')[1].split("</thead>")[0]
    assert "Chip-hours per person, a bar per day" in body
    assert re.findall(r'<th scope="col">([^<]+)</th>', head) == ["Day", "ann", "milo", "Total"]
    assert "The largest bar is 11 Jan 2026: 80.00 chip-hours" in body
    assert '<strong id="usage-total">22.50</strong> worker-hours' in body
    # pod1: 5 h of its 11th (the two jobs overlap in these rows); tpu5: 2.5 h of the 10th.
    assert _chart_table(body, "chart-held") == [
        ["pod1", HELD, "10 %", "0 %", "21 %"],
        ["pod1", DUTY, "no reading", "no reading", "no reading"],
        ["tpu5", HELD, "5 %", "10 %", "0 %"],
        ["tpu5", DUTY, "no reading", "no reading", "no reading"],
    ]
    assert [row[:2] for row in _chart_table(body, "chart-waits")] == [
        ["10 Jan 2026", "1"],
        ["11 Jan 2026", "2"],
    ]


def _read_chips(vm, first: dt.datetime, duty: float, readings: int = 2) -> None:
    """``readings`` of ``vm``'s chips 10 s apart from ``first``, each at ``duty`` %."""
    from tpus.remote.jobs import ChipMetrics, WorkerMetrics

    answer = {0: WorkerMetrics([ChipMetrics(0, 1, 2, duty), ChipMetrics(1, 1, 2, duty)])}
    for n in range(readings):
        chip_metrics.record(vm, answer, now=first + dt.timedelta(seconds=10 * n))


def test_the_page_shows_each_vms_duty_cycle_beside_the_time_held(client, scene, history, settings):
    settings.PORTAL_CHIP_METRICS_EVERY_SECONDS = 10
    pod = TpuVm.objects.get(name="pod1")
    _read_chips(pod, at(11, 21), 80.0, readings=4)
    # 30 s at 80 %; then, an hour later, the 20 s cap and 10 s at 20 %: 50 %.
    _read_chips(pod, at(11, 22), 20.0)
    _read_chips(scene.vm, at(9, 23), 100.0)  # before the period
    for who in (scene.admin, scene.ann):
        client.force_login(who)
        body = _usage(client)
        rows = _chart_table(body, "chart-held")
        assert ["pod1", DUTY, "50 %", "no reading", "50 %"] in rows
        assert ["tpu5", DUTY, "no reading", "no reading", "no reading"] in rows
        card = body[body.index('id="chart-held"') :]
        card = card[: card.index("</section>")]
        assert "Duty cycle (mean while observed)</li>" in card  # the legend
        drawing = card[card.index('<svg class="chart"') :]
        assert re.search(r'<rect x="[^"]+" [^>]*fill="url\(#chart-held-s1\)"/>', drawing)


def test_another_labs_duty_cycle_is_never_read_for_this_lab(client, scene, history, cast):
    theirs = make_vm(cast.other_lab, "theirs")
    make_job(theirs, cast.outsider, "succeeded", started_at=at(10, 1), ended_at=at(10, 2))
    _read_chips(theirs, at(10, 1), 90.0)
    days = bins(dt.date(2026, 1, 10), dt.date(2026, 1, 11))
    assert chip_metrics.duty_days(scene.lab, [theirs.pk, scene.vm.pk], days) == {}
    assert chip_metrics.duty_days(cast.other_lab, [theirs.pk], days) == {
        theirs.pk: {dt.date(2026, 1, 10): DutyDay(10.0, 9.0)}
    }
    client.force_login(scene.admin)
    body = _usage(client)
    assert "theirs" not in body and "90 %" not in _chart_table(body, "chart-held")


def test_the_waits_are_from_submission_to_start_on_the_day_it_started(client, scene):
    vm = scene.vm
    make_job(vm, scene.milo, "succeeded", queued_at=at(9, 23), started_at=at(10, 1),
             ended_at=at(10, 2))  # fmt: skip
    make_job(vm, scene.ann, "succeeded", queued_at=at(10, 3), started_at=at(10, 3, 5),
             ended_at=at(10, 4))  # fmt: skip
    make_job(vm, scene.ann, "succeeded", queued_at=at(10, 3), started_at=at(10, 4, 30),
             ended_at=at(10, 5))  # fmt: skip
    make_job(
        vm,
        scene.ann,
        "running",
        queued_at=at(11, 3),
        started_at=at(11, 3) + dt.timedelta(seconds=40),
    )
    make_job(vm, scene.milo, "queued", queued_at=at(10, 1))  # not started: not in it
    client.force_login(scene.admin)
    # 2 h, 5 min and 1 h 30 min on the 10th; 40 s on the 11th.
    expected = [
        ["10 Jan 2026", "3", "0", "1", "0", "2", "0", "2 h"],
        ["11 Jan 2026", "1", "1", "0", "0", "0", "0", "40 s"],
    ]
    assert _chart_table(_usage(client), "chart-waits") == expected
    usage.count_all_ended_jobs()
    assert _chart_table(_usage(client), "chart-waits") == expected
    client.force_login(scene.milo)
    assert _chart_table(_usage(client), "chart-waits") == [
        ["10 Jan 2026", "1", "0", "0", "0", "1", "0", "2 h"],
        ["11 Jan 2026", "0", "0", "0", "0", "0", "0", "–"],
    ]


def test_a_member_sees_charts_of_their_own_jobs_only(client, scene, history):
    client.force_login(scene.milo)
    body = _usage(client)
    assert _chart_table(body, "chart-people") == [
        ["10 Jan 2026", "8.00", "8.00"],
        ["11 Jan 2026", "16.00", "16.00"],
    ]
    assert "ann" not in body.split('id="chart-people"')[1]
    assert "Everyone else" not in body
    assert "Share of each day your jobs held each TPU VM" in body


def test_many_people_on_the_page_are_the_five_most_used_and_everyone_else(client, scene, make_user):
    for n in range(7):
        person = make_user(f"p{n}@vision.example")
        account(person, f"p{n}")
        Grant.objects.create(user=person, vm=scene.vm, state="active")
        make_job(scene.vm, person, "succeeded", started_at=at(10, 0), ended_at=at(10, n + 1))
    client.force_login(scene.admin)
    body = _usage(client)
    # n + 1 hours each on tpu5, a v4-8: 4 chip-hours an hour.
    assert _chart_table(body, "chart-people")[0] == [
        "10 Jan 2026", "28.00", "24.00", "20.00", "16.00", "12.00", "12.00", "112.00",
    ]  # fmt: skip
    head = body.split('id="chart-people-table"')[1].split("</thead>")[0]
    assert re.findall(r'<th scope="col">([^<]+)</th>', head) == [
        "Day", "p6", "p5", "p4", "p3", "p2", "Everyone else", "Total",
    ]  # fmt: skip


def test_another_labs_usage_and_its_charts_are_not_found(client, scene, cast):
    theirs = make_vm(cast.other_lab, "theirs")
    make_job(theirs, cast.outsider, "succeeded", started_at=at(10, 1), ended_at=at(10, 2))
    for who in (scene.milo, scene.admin):
        client.force_login(who)
        response = client.get(reverse("lab_usage", args=["other"]) + PERIOD)
        assert response.status_code == 404
        assert b"chart-people" not in response.content
    client.force_login(cast.outsider)
    body = client.get(reverse("lab_usage", args=["other"]) + PERIOD).content.decode()
    assert _chart_table(body, "chart-held") == [
        ["theirs", HELD, "2 %", "4 %", "0 %"],
        ["theirs", DUTY, "no reading", "no reading", "no reading"],
    ]


def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as context:
        assert client.get(url).status_code == 200
    return len(context)


@pytest.mark.parametrize("who", ["admin", "milo"])
def test_the_charts_cost_seven_queries_and_two_once_their_sums_are_in_the_cache(
    client, scene, history, who, monkeypatch
):
    from django.core.cache import cache

    usage.count_all_ended_jobs()
    client.force_login(scene.admin if who == "admin" else scene.milo)
    url = reverse("lab_usage", args=["vision"]) + PERIOD

    def cold():
        cache.delete(f"tpu-portal:usage-version:{scene.lab.pk}")
        return _queries(client, url)

    vms = sorted(TpuVm.objects.filter(lab=scene.lab).values_list("pk", flat=True))
    duty = usage_charts.duty_key(scene.lab.pk, vms, bins(dt.date(2026, 1, 10), JAN[10]))

    def colder():
        cache.delete(duty)
        return cold()

    _queries(client, url)
    with_charts = (colder(), cold(), _queries(client, url))
    monkeypatch.setattr(usage_charts, "for_usage", lambda *a, **k: [])
    without = (colder(), cold(), _queries(client, url))
    # Nothing in the cache: the five most used people and their names, the per-day sums
    # of people and of VMs, the VMs' workers and duty cycle, the waits. After jobs were
    # counted, the duty cycle (kept a minute) is not read again. Then only the names
    # and the workers.
    assert [a - b for a, b in zip(with_charts, without, strict=True)] == [7, 6, 2]

"""Charts of a lab's TPU usage over a period (``portal.charts`` draws them):
chip-hours per person per day (stacked), the share of each day a portal job held
each TPU VM beside how busy its chips were (their mean duty cycle while read), and
how long jobs waited to start.

Each chart is made by a pure function from its series to a ``Chart``, with the rows of
the table that holds the same figures. ``read_series`` reads the series from
``services.usage`` in a fixed number of queries, whatever the number of jobs or
people; ``draw`` makes the charts of them."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from dataclasses import dataclass

from django.core.cache import cache
from django.utils import timezone

from portal.charts import (
    BARS_HEIGHT,
    BOTTOM,
    FONT,
    RIGHT,
    TOP,
    WIDTH,
    Bin,
    Chart,
    Rect,
    Series,
    Text,
    bin_word,
    bins,
    per_bar,
    stack,
    styled,
)
from tpus.services import chip_metrics, usage

NAMES = 110  # room for a TPU VM's name at the left of its row
ROW = 30  # one TPU VM's row in the chart of time held
TOP_PEOPLE = 5
HELD_VMS = 20

HELD = (
    "Time held: the share of the time a job the portal started was running on the TPU VM "
    "(a running job holds every chip of it). Duty cycle: how busy the VM's chips were (the "
    "mean of their TensorCore duty cycle), whoever ran on them, over the time the portal "
    "read them (about every few seconds while a job runs); “no reading” where they were "
    "not read. A process outside the portal is seen only when the portal looks, so its "
    "time is not in time held."
)
HELD_SERIES = ["Time held", "Duty cycle (mean while observed)"]
NO_READING = "no reading"
WAITED = (
    "A job's wait: from when it was submitted until it ran on every worker, counted on the "
    "day it started. Jobs that have not started are not in it."
)

# --- chip-hours per person per day -----------------------------------------------------


def people_chart(
    bars: list[Bin],
    people: list[tuple[int, str]],
    per_day: dict[dt.date, dict],
    *,
    everyone: bool,
) -> Chart:
    """Stacked bars of chip-hours per bar of days: one part per person of ``people``
    (id, name: the most used first) and, when ``everyone`` was counted, one for the
    rest of the lab. ``per_day``: ``Usage.per_day("user", ..., chips=True)``."""
    labels = [name for _, name in people]
    sums = per_bar(bars, per_day, [ident for ident, _ in people] + [None])
    values = [[t.total_seconds() / 3600 for t in sums[ident]] for ident, _ in people]
    if everyone:
        rest = [
            max(t.total_seconds() / 3600 - sum(v[n] for v in values), 0.0)
            for n, t in enumerate(sums[None])
        ]
        if any(v > 0.005 for v in rest):
            labels.append("Everyone else")
            values.append(rest)
    word = bin_word(bars)
    chart = Chart(
        id="chart-people",
        title=f"Chip-hours per person, a bar per {word.lower()}",
        description="",
        height=BARS_HEIGHT,
        series=styled(labels),
        head=[word, *labels, "Total"],
    )
    totals = stack(chart, bars, values)
    for n, (b, total) in enumerate(zip(bars, totals, strict=True)):
        chart.rows.append([b.label, *(f"{v[n]:.2f}" for v in values), f"{total:.2f}"])
    busiest = max(range(len(bars)), key=lambda n: totals[n]) if bars else None
    chart.description = (
        f"Stacked bars from {bars[0].label} to {bars[-1].label}, chip-hours of "
        + (", ".join(labels) if labels else "no one")
        + (
            f". The largest bar is {bars[busiest].label}: {totals[busiest]:.2f} chip-hours"
            if busiest is not None and totals[busiest] > 0
            else ". No job ran"
        )
        + ". The table below the chart has every figure."
    )
    return chart


# --- time held per TPU VM --------------------------------------------------------------


def day_lengths(bars: list[Bin], now: dt.datetime) -> dict[dt.date, dt.timedelta]:
    """How much of each day had passed at ``now`` (a whole day for a past one)."""
    zone = timezone.get_current_timezone()
    days = [day for b in bars for day in b.days]
    # Instants as timestamps: two aware times of one zone subtract as wall-clock
    # times, which would make every day 24 hours long, DST or not.
    ends = [
        dt.datetime.combine(day, dt.time(), tzinfo=zone).timestamp()
        for day in (*days, days[-1] + dt.timedelta(days=1))
    ]
    now_ts = now.timestamp()
    return {
        day: dt.timedelta(seconds=max(min(ends[n + 1], now_ts) - ends[n], 0))
        for n, day in enumerate(days)
    }


def held_chart(
    bars: list[Bin],
    vms: list[tuple[int, str]],
    per_day: dict[dt.date, dict],
    workers: dict[int, int],
    lengths: dict[dt.date, dt.timedelta],
    duty: dict[int, dict[dt.date, chip_metrics.DutyDay]] | None = None,
    *,
    whose: str = "a portal job",
) -> Chart:
    """A row per TPU VM of ``vms`` (id, name), a bar per bar of days: the share of
    that time a portal job held the VM's chips and, beside it, the chips' mean duty
    cycle over the time they were read (``duty``: ``chip_metrics.duty_days``, by
    VM and day or a bar's first day; none read is "no reading", not 0). A job runs
    on every worker of its VM at once, so its worker-time over the VM's ``workers``
    is its time.

    What holds a chip outside the portal is seen only at a look, not over time, so
    is not in it."""
    series = styled(HELD_SERIES)
    passed = per_bar(bars, {day: {None: time} for day, time in lengths.items()}, [None])[None]
    held = per_bar(bars, per_day, [ident for ident, _ in vms])
    bar_of = {day: n for n, b in enumerate(bars) for day in b.days}
    values, overall = [], []
    for ident, _ in vms:
        times = [time / (workers.get(ident) or 1) for time in held[ident]]
        observed, busy = [0.0] * len(bars), [0.0] * len(bars)
        for day, found in (duty or {}).get(ident, {}).items():
            if day in bar_of:
                observed[bar_of[day]] += found.observed
                busy[bar_of[day]] += found.busy
        values.append(
            [
                [_share(t, p) for t, p in zip(times, passed, strict=True)],
                [_mean(b, o) for b, o in zip(busy, observed, strict=True)],
            ]
        )
        overall.append(
            [
                _share(sum(times, dt.timedelta()), sum(passed, dt.timedelta())),
                _mean(sum(busy), sum(observed)),
            ]
        )
    chart = _rows_chart(
        "chart-held",
        f"Share of each {bin_word(bars).lower()} {whose} held each TPU VM, and its chips' "
        "duty cycle",
        bars,
        [name for _, name in vms],
        series,
        values,
        overall=overall,
        missing=["–", NO_READING],
    )
    chart.note = HELD
    return chart


def _share(held: dt.timedelta, passed: dt.timedelta) -> float | None:
    """``held`` of ``passed``; None for time that has not begun yet."""
    return min(held / passed, 1.0) if passed else None


def _mean(busy: float, observed: float) -> float | None:
    """The mean duty cycle over ``observed`` seconds (0 to 1); None when none was."""
    return min(max(busy / observed, 0.0), 1.0) if observed > 0 else None


def _rows_chart(
    chart_id: str,
    title: str,
    bars: list[Bin],
    names: list[str],
    series: list[Series],
    values: list[list[list[float | None]]],  # per row, per series, per bar: 0 to 1
    *,
    overall: list[list[float | None]],  # per row, per series
    missing: list[str],  # a cell without a value, per series
) -> Chart:
    """A row per name, each series' bars side by side in it; in the table, a row per
    name and series."""
    chart = Chart(
        id=chart_id,
        title=title,
        description="",
        height=TOP + ROW * max(len(names), 1) + BOTTOM,
        series=series,
        head=["TPU VM", "Figure", "Whole period", *(b.label for b in bars)],
        left=NAMES,
    )
    slot = (WIDTH - NAMES - RIGHT) / len(bars)
    band = ROW - 6
    for r, name in enumerate(names):
        base = TOP + (r + 1) * ROW - 3
        chart.grid.append(base)
        chart.guides.append(base - band)  # a full bar's top
        chart.texts.append(Text(NAMES - 4, base - band / 2 + FONT / 3, _short(name), "end"))
        width = max(slot * 0.8 / len(series), 0.5)
        for s, bar_values in enumerate(values[r]):
            for n, value in enumerate(bar_values):
                if not value:
                    continue
                x = NAMES + n * slot + slot * 0.1 + s * width
                chart.rects.append(Rect(x, base - value * band, width, value * band, s, value))
        for s, bar_values in enumerate(values[r]):
            cells = [_percent(v, missing[s]) for v in [overall[r][s], *bar_values]]
            chart.rows.append([name, series[s].label, *cells])
    every = math.ceil(len(bars) / 5)
    for n in range(0, len(bars), every):
        chart.texts.append(Text(NAMES + (n + 0.5) * slot, chart.height - 6, bars[n].short))
    chart.description = (
        f"A row per TPU VM ({len(names)}), a bar per {bin_word(bars).lower()} from "
        f"{bars[0].label} to {bars[-1].label}, "
        + " and ".join(s.label.lower() for s in series)
        + " side by side; a full-height bar is 100 %. "
        + (
            "; ".join(
                f"{n} over the period: "
                + ", ".join(
                    f"{series[s].label.lower()} {_percent(o, missing[s])}"
                    for s, o in enumerate(whole)
                )
                for n, whole in zip(names, overall, strict=True)
            )
            if names
            else "No TPU VM was used"
        )
        + ". The table below the chart has every figure."
    )
    return chart


def _short(name: str, size: int = 14) -> str:
    return name if len(name) <= size else name[: size - 1] + "…"


def _percent(value: float | None, missing: str = "–") -> str:
    return missing if value is None else f"{value * 100:.0f} %"


# --- waiting to start ------------------------------------------------------------------


# The spans of ``usage.WAIT_EDGES``, shortest first, each with its own colour and
# pattern (green for the shortest, through to red and purple for the longest).
WAIT_SPANS = [
    Series("under 1 min", "#176b32", "solid"),
    Series("1–10 min", "#1f5fd6", "stripes"),
    Series("10 min–1 h", "#8a5100", "dots"),
    Series("1–6 h", "#b3261e", "cross"),
    Series("6 h or more", "#6b3fa0", "rows"),
]


def wait_chart(bars: list[Bin], waits: dict[dt.date, usage.Waits]) -> Chart:
    """A bar per bar of days: the jobs that started then, stacked by how long they
    waited (from being submitted until running on every worker), and in the table
    the longest wait. ``waits``: ``Usage.waits()``."""
    per_bar = [usage.Waits() for _ in bars]
    bar_of = {day: n for n, b in enumerate(bars) for day in b.days}
    for day, found in waits.items():
        if day in bar_of:
            into = per_bar[bar_of[day]]
            into.counts = [a + b for a, b in zip(into.counts, found.counts, strict=True)]
            into.longest = max(into.longest, found.longest)
    word = bin_word(bars)
    chart = Chart(
        id="chart-waits",
        title=f"Jobs that started each {word.lower()}, by how long they waited",
        description="",
        height=BARS_HEIGHT,
        series=WAIT_SPANS,
        head=[word, "Jobs started", *(f"Waited {s.label}" for s in WAIT_SPANS), "Longest wait"],
        note=WAITED,
    )
    values = [[float(w.counts[s]) for w in per_bar] for s in range(len(WAIT_SPANS))]
    totals = stack(chart, bars, values, whole=True)
    for b, w, total in zip(bars, per_bar, totals, strict=True):
        longest = _wait(w.longest) if total else "–"
        chart.rows.append([b.label, str(round(total)), *map(str, w.counts), longest])
    started = round(sum(totals))
    longest = max((w.longest for w in per_bar if sum(w.counts)), default=None)
    spans = [(sum(w.counts[s] for w in per_bar), span) for s, span in enumerate(WAIT_SPANS)]
    chart.description = (
        f"Stacked bars from {bars[0].label} to {bars[-1].label}: the jobs that started, "
        f"by how long they waited. {started} job{'s' if started != 1 else ''} started"
        + (
            ": "
            + ", ".join(f"{n} waited {s.label}" for n, s in spans if n)
            + f"; the longest waited {_wait(longest)}"
            if started
            else ""
        )
        + ". The table below the chart has every figure."
    )
    return chart


def _wait(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


# --- the usage page's charts -----------------------------------------------------------


# How long the chips' duty cycle per VM and bar stays in the shared cache: its rows
# change at every reading, not when jobs are counted, so a day's bar may be this far
# behind its latest readings.
DUTY_CACHED_SECONDS = 60


def duty_key(lab_id: int, vm_ids: list[int], bars: list[Bin]) -> str:
    return ":".join(
        ["tpu-portal:usage-duty", str(lab_id), bars[0].first.isoformat(),
         bars[-1].last.isoformat(), bin_word(bars),
         hashlib.sha256(",".join(map(str, sorted(vm_ids))).encode()).hexdigest()[:16]]
    )  # fmt: skip


def duty_of(lab, vm_ids: list[int], bars: list[Bin]) -> dict:
    """``chip_metrics.duty_days`` of the VMs, from the shared cache when read less than
    ``DUTY_CACHED_SECONDS`` ago (one query otherwise)."""
    key = duty_key(lab.pk, vm_ids, bars)
    found = cache.get(key)
    if found is None:
        found = chip_metrics.duty_days(lab, vm_ids, bars)
        cache.set(key, found, timeout=DUTY_CACHED_SECONDS)
    return found


@dataclass
class UsageSeries:
    """What the usage page's charts are drawn from (``read_series``)."""

    bars: list[Bin]
    everyone: bool
    people: list[tuple[int, str]]
    people_days: dict[dt.date, dict]
    vms: list[tuple[int, str]]
    more_vms: bool  # the page of VMs has more than the chart shows
    vm_days: dict[dt.date, dict]
    duty: dict[int, dict[dt.date, chip_metrics.DutyDay]]
    workers: dict[int, int]
    lengths: dict[dt.date, dt.timedelta]
    waits: dict[dt.date, usage.Waits]


def read_series(figures: usage.Usage, vm_rows: list[dict], *, everyone: bool) -> UsageSeries:
    """The series of ``figures``' period: the most used people's chip-time per day,
    that of the TPU VMs of ``vm_rows`` (a page of ``usage.MostUsedFirst``, named; its
    first ``HELD_VMS``), their workers and their chips' duty cycle per day, and the
    waits. Seven queries at most, four of them kept in the cache until more jobs are
    counted, and the duty cycle for ``DUTY_CACHED_SECONDS`` (``duty_of``)."""
    period = figures.period
    bars = bins(period.first, period.last)
    top = usage.name_people(figures.ranked("user", 0, TOP_PEOPLE))
    people = [(row["id"], row["username"] or row["email"]) for row in top]
    vms = [(row["id"], row["vm_name"]) for row in vm_rows[:HELD_VMS]]
    return UsageSeries(
        bars=bars,
        everyone=everyone,
        people=people,
        people_days=figures.per_day("user", [ident for ident, _ in people], chips=True),
        vms=vms,
        more_vms=len(vm_rows) > HELD_VMS,
        vm_days=figures.per_day("vm", [ident for ident, _ in vms]),
        duty=duty_of(figures.lab, [ident for ident, _ in vms], bars),
        workers=usage.worker_counts(ident for ident, _ in vms),
        lengths=day_lengths(bars, figures.now),
        waits=figures.waits(),
    )


def draw(series: UsageSeries) -> list[Chart]:
    """The usage page's three charts of ``series``; no query."""
    held = held_chart(
        series.bars,
        series.vms,
        series.vm_days,
        series.workers,
        series.lengths,
        series.duty,
        whose="a portal job" if series.everyone else "your jobs",
    )
    if series.more_vms:
        held.note += f" The {HELD_VMS} TPU VMs of this page of “Per TPU VM” used the most."
    return [
        people_chart(series.bars, series.people, series.people_days, everyone=series.everyone),
        held,
        wait_chart(series.bars, series.waits),
    ]


def for_usage(figures: usage.Usage, vm_rows: list[dict], *, everyone: bool) -> list[Chart]:
    """The usage page's charts (``read_series``, then ``draw``)."""
    return draw(read_series(figures, vm_rows, everyone=everyone))

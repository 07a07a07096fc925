"""Charts of a lab's TPU usage over a period, drawn on the server as inline SVG:
worker-hours per person per day (stacked), the share of each day a portal job held
each TPU VM, and how long jobs waited to start.

Each chart is made by a pure function from its series to a ``Chart``: the shapes to
draw, in the drawing's own units (a viewBox, so it scales to its box), and the rows of
the table that holds the same figures. ``Chart.svg`` writes the shapes out, every text
escaped. ``for_usage`` reads the series from ``services.usage`` in a fixed number of
queries, whatever the number of jobs or people."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from html import escape

from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe

from tpus.services import usage

WIDTH = 360  # the drawing's width, in its own units
FONT = 12
LEFT = 40  # room for the value axis's labels
NAMES = 110  # room for a TPU VM's name at the left of its row
RIGHT = 20  # room for half of the last bar's label
TOP = 8
BOTTOM = 22  # room for the days under the bars
PLOT_HEIGHT = 150
ROW = 30  # one TPU VM's row in the chart of time held
DAILY_UP_TO = 62  # a longer period is drawn a week a bar
TOP_PEOPLE = 5
HELD_VMS = 20
TEXT = "#5b6577"  # 5.8:1 on white
GRID = "#dde1ea"

HELD = (
    "Time held: the share of the time a job the portal started was running on the TPU VM "
    "(a running job holds every chip of it). How busy the chips were inside the job (their "
    "duty cycle) is not read yet, and a process outside the portal is seen only when the "
    "portal looks, so neither is in this chart."
)
WAITED = (
    "A job's wait: from when it was submitted until it ran on every worker, counted on the "
    "day it started. Jobs that have not started are not in it."
)

# Fills with at least 3:1 contrast on white (WCAG 1.4.11), each with its own pattern
# as well, so that no series is told from its neighbour by colour alone.
STYLES = [
    ("#1f5fd6", "solid"),
    ("#b3261e", "stripes"),
    ("#176b32", "dots"),
    ("#8a5100", "cross"),
    ("#6b3fa0", "rows"),
    ("#5b6577", "columns"),
]


# --- days and bars ---------------------------------------------------------------------


@dataclass(frozen=True)
class Bin:
    """The days one bar stands for: one day, or a week of a long period."""

    first: dt.date
    last: dt.date

    @property
    def days(self) -> list[dt.date]:
        return [self.first + dt.timedelta(days=n) for n in range((self.last - self.first).days + 1)]

    @property
    def short(self) -> str:
        return f"{self.first.day} {self.first:%b}"

    @property
    def label(self) -> str:
        if self.first == self.last:
            return f"{self.first.day} {self.first:%b %Y}"
        first = f"{self.first:%b}" if self.first.year == self.last.year else f"{self.first:%b %Y}"
        return f"{self.first.day} {first} – {self.last.day} {self.last:%b %Y}"


def bins(first: dt.date, last: dt.date) -> list[Bin]:
    """A bar per day from ``first`` to ``last``, or per week (the last one shorter)
    when there are more than ``DAILY_UP_TO`` days."""
    step = 1 if (last - first).days + 1 <= DAILY_UP_TO else 7
    found, day = [], first
    while day <= last:
        end = min(day + dt.timedelta(days=step - 1), last)
        found.append(Bin(day, end))
        day = end + dt.timedelta(days=1)
    return found


def _bin_word(bars: list[Bin]) -> str:
    return "Day" if all(b.first == b.last for b in bars) else "Week"


# --- what a chart is -------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    label: str
    colour: str
    pattern: str


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    width: float
    height: float
    series: int  # index into Chart.series
    value: float  # what its height stands for, in the chart's unit


@dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    anchor: str = "middle"


@dataclass
class Chart:
    """One chart: its shapes (in a ``WIDTH`` by ``height`` drawing) and its table
    (``head``; ``rows``, each a row header and its cells)."""

    id: str
    title: str
    description: str
    height: float
    series: list[Series]
    rects: list[Rect] = field(default_factory=list)
    texts: list[Text] = field(default_factory=list)
    grid: list[float] = field(default_factory=list)  # y of each horizontal line
    left: float = LEFT  # where the plot (and its lines) begins
    guides: list[float] = field(default_factory=list)  # y of each dotted line
    head: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    @property
    def legend(self) -> list[tuple[str, Series]]:
        """(pattern id, series) of each series, for the legend beside the drawing."""
        return [(f"{self.id}-s{n}", s) for n, s in enumerate(self.series)]

    @property
    def svg(self) -> SafeString:
        return render(self)

    @property
    def table(self) -> SafeString:
        return render_table(self)


def _styled(labels: list[str]) -> list[Series]:
    return [Series(label, *STYLES[n % len(STYLES)]) for n, label in enumerate(labels)]


def _scale(top: float, ticks: int = 4, *, whole: bool = False) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten; a whole number when
    ``whole``) for ``ticks`` lines that reach ``top``."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    steps = [m * power for m in (1, 2, 2.5, 5, 10)]
    if whole:
        steps = [max(round(step), 1) for step in steps if step >= 1 and step == round(step)]
        steps = steps or [1]
    return next((step for step in steps if step >= raw * (1 - 1e-9)), steps[-1])


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _axes(chart: Chart, bars: list[Bin], left: float, top_value: float, step: float) -> float:
    """The value axis's lines and labels, and the bars' labels under the plot; returns
    the width of one bar's slot."""
    slot = (WIDTH - left - RIGHT) / len(bars)
    base = TOP + PLOT_HEIGHT
    for n in range(round(top_value / step) + 1):
        y = base - n * step * PLOT_HEIGHT / top_value
        chart.grid.append(y)
        chart.texts.append(Text(left - 4, y + FONT / 3, _number(n * step), "end"))
    every = math.ceil(len(bars) / 6)
    for n in range(0, len(bars), every):
        chart.texts.append(Text(left + (n + 0.5) * slot, base + FONT + 4, bars[n].short))
    return slot


# --- worker-hours per person per day ---------------------------------------------------


def people_chart(
    bars: list[Bin],
    people: list[tuple[int, str]],
    per_day: dict[dt.date, dict],
    *,
    everyone: bool,
) -> Chart:
    """Stacked bars of worker-hours per bar of days: one part per person of ``people``
    (id, name: the most used first) and, when ``everyone`` was counted, one for the
    rest of the lab. ``per_day``: ``Usage.per_day("user", ...)``."""
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
    word = _bin_word(bars)
    chart = Chart(
        id="chart-people",
        title=f"Worker-hours per person, a bar per {word.lower()}",
        description="",
        height=TOP + PLOT_HEIGHT + BOTTOM,
        series=_styled(labels),
        head=[word, *labels, "Total"],
    )
    totals = _stack(chart, bars, values)
    for n, (b, total) in enumerate(zip(bars, totals, strict=True)):
        chart.rows.append([b.label, *(f"{v[n]:.2f}" for v in values), f"{total:.2f}"])
    busiest = max(range(len(bars)), key=lambda n: totals[n]) if bars else None
    chart.description = (
        f"Stacked bars from {bars[0].label} to {bars[-1].label}, worker-hours of "
        + (", ".join(labels) if labels else "no one")
        + (
            f". The largest bar is {bars[busiest].label}: {totals[busiest]:.2f} worker-hours"
            if busiest is not None and totals[busiest] > 0
            else ". No job ran"
        )
        + ". The table below the chart has every figure."
    )
    return chart


def per_bar(bars: list[Bin], per_day: dict[dt.date, dict], idents) -> dict:
    """Each of ``idents``' time (``Usage.per_day``) summed per bar: one pass over
    the days that have any."""
    bar_of = {day: n for n, b in enumerate(bars) for day in b.days}
    found = {ident: [dt.timedelta()] * len(bars) for ident in idents}
    for day, sums in per_day.items():
        n = bar_of.get(day)
        if n is None:
            continue
        for ident, time in sums.items():
            if ident in found and time:
                found[ident][n] += time
    return found


def _stack(
    chart: Chart, bars: list[Bin], values: list[list[float]], *, whole: bool = False
) -> list[float]:
    """One rectangle per series and bar, stacked; returns each bar's total. ``whole``:
    the values count things, so the axis's steps are whole numbers."""
    totals = [sum(v[n] for v in values) for n in range(len(bars))]
    step = _scale(max(totals, default=0), whole=whole)
    top_value = step * max(1, math.ceil(max(totals, default=0) / step - 1e-9))
    slot = _axes(chart, bars, LEFT, top_value, step)
    width = max(slot * 0.75, 0.5)
    for n in range(len(bars)):
        x = LEFT + n * slot + (slot - width) / 2
        y = TOP + PLOT_HEIGHT
        for s, series in enumerate(values):
            if series[n] <= 0:
                continue
            height = series[n] * PLOT_HEIGHT / top_value
            y -= height
            chart.rects.append(Rect(x, y, width, height, s, series[n]))
    return totals


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
    *,
    whose: str = "a portal job",
) -> Chart:
    """A row per TPU VM of ``vms`` (id, name), a bar per bar of days: the share of
    that time a portal job held the VM's chips. A job runs on every worker of its VM
    at once, so its worker-time over the VM's ``workers`` is its time.

    Each row can hold more than one series side by side (``series``); what holds a
    chip outside the portal is seen only at a look, not over time, so is not in it."""
    series = _styled(["Time held"])
    passed = per_bar(bars, {day: {None: time} for day, time in lengths.items()}, [None])[None]
    held = per_bar(bars, per_day, [ident for ident, _ in vms])
    rows, overall = [], []
    for ident, _ in vms:
        times = [time / (workers.get(ident) or 1) for time in held[ident]]
        rows.append([_share(t, p) for t, p in zip(times, passed, strict=True)])
        overall.append(_share(sum(times, dt.timedelta()), sum(passed, dt.timedelta())))
    chart = _rows_chart(
        "chart-held",
        f"Share of each {_bin_word(bars).lower()} {whose} held each TPU VM",
        bars,
        [name for _, name in vms],
        series,
        [[row] for row in rows],
        overall=overall,
    )
    chart.note = HELD
    return chart


def _share(held: dt.timedelta, passed: dt.timedelta) -> float | None:
    """``held`` of ``passed``; None for time that has not begun yet."""
    return min(held / passed, 1.0) if passed else None


def _rows_chart(
    chart_id: str,
    title: str,
    bars: list[Bin],
    names: list[str],
    series: list[Series],
    values: list[list[list[float | None]]],  # per row, per series, per bar: 0 to 1
    *,
    overall: list[float | None],
) -> Chart:
    chart = Chart(
        id=chart_id,
        title=title,
        description="",
        height=TOP + ROW * max(len(names), 1) + BOTTOM,
        series=series,
        head=["TPU VM", "Whole period", *(b.label for b in bars)],
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
        for s, per_bar in enumerate(values[r]):
            for n, value in enumerate(per_bar):
                if not value:
                    continue
                x = NAMES + n * slot + slot * 0.1 + s * width
                chart.rects.append(Rect(x, base - value * band, width, value * band, s, value))
        cells = [_percent(v) for v in values[r][0]]
        chart.rows.append([name, _percent(overall[r]), *cells])
    every = math.ceil(len(bars) / 5)
    for n in range(0, len(bars), every):
        chart.texts.append(Text(NAMES + (n + 0.5) * slot, chart.height - 6, bars[n].short))
    chart.description = (
        f"A row per TPU VM ({len(names)}), a bar per {_bin_word(bars).lower()} from "
        f"{bars[0].label} to {bars[-1].label}; a full-height bar is the whole of that time. "
        + (
            "; ".join(
                f"{n}: {_percent(o)} of the period" for n, o in zip(names, overall, strict=True)
            )
            if names
            else "No TPU VM was used"
        )
        + ". The table below the chart has every figure."
    )
    return chart


def _short(name: str, size: int = 14) -> str:
    return name if len(name) <= size else name[: size - 1] + "…"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"


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
    word = _bin_word(bars)
    chart = Chart(
        id="chart-waits",
        title=f"Jobs that started each {word.lower()}, by how long they waited",
        description="",
        height=TOP + PLOT_HEIGHT + BOTTOM,
        series=WAIT_SPANS,
        head=[word, "Jobs started", *(f"Waited {s.label}" for s in WAIT_SPANS), "Longest wait"],
        note=WAITED,
    )
    values = [[float(w.counts[s]) for w in per_bar] for s in range(len(WAIT_SPANS))]
    totals = _stack(chart, bars, values, whole=True)
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


# --- drawing ---------------------------------------------------------------------------


def _pattern(pid: str, colour: str, kind: str) -> str:
    """A fill: the colour, with white marks of its own kind over it."""
    marks = {
        "solid": "",
        "stripes": '<path d="M0 0V6" stroke="#fff" stroke-width="2"/>',
        "dots": '<circle cx="3" cy="3" r="1.3" fill="#fff"/>',
        "cross": '<path d="M0 3H6M3 0V6" stroke="#fff" stroke-width="1"/>',
        "rows": '<path d="M0 3H6" stroke="#fff" stroke-width="1.5"/>',
        "columns": '<path d="M3 0V6" stroke="#fff" stroke-width="1.5"/>',
    }[kind]
    turn = ' patternTransform="rotate(45)"' if kind == "stripes" else ""
    return (
        f'<pattern id="{pid}" width="6" height="6" patternUnits="userSpaceOnUse"{turn}>'
        f'<rect width="6" height="6" fill="{colour}"/>{marks}</pattern>'
    )


def render(chart: Chart) -> SafeString:
    """The chart as an inline ``<svg role="img">`` named by its title and description;
    every text in it escaped."""
    cid = escape(chart.id)
    out = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {chart.height:.0f}" '
        f'aria-labelledby="{cid}-title {cid}-desc" font-size="{FONT}" '
        f'font-family="system-ui, sans-serif" xmlns="http://www.w3.org/2000/svg">',
        f'<title id="{cid}-title">{escape(chart.title)}</title>',
        f'<desc id="{cid}-desc">{escape(chart.description)}</desc><defs>',
        *(_pattern(pid, s.colour, s.pattern) for pid, s in chart.legend),
        "</defs>",
    ]
    if chart.grid:
        lines = "".join(f"M{chart.left} {y:.1f}H{WIDTH - RIGHT}" for y in chart.grid)
        out.append(f'<path d="{lines}" stroke="{GRID}" stroke-width="0.75" fill="none"/>')
    if chart.guides:
        lines = "".join(f"M{chart.left} {y:.1f}H{WIDTH - RIGHT}" for y in chart.guides)
        out.append(
            f'<path d="{lines}" stroke="{GRID}" stroke-width="0.75" stroke-dasharray="2 2" '
            'fill="none"/>'
        )
    fills = [f"url(#{cid}-s{n})" for n in range(len(chart.series))]
    out.append('<g stroke="#fff" stroke-width="0.5">')
    out.extend(
        f'<rect x="{r.x:.1f}" y="{r.y:.1f}" width="{r.width:.1f}" height="{r.height:.1f}" '
        f'fill="{fills[r.series]}"/>'
        for r in chart.rects
    )
    out.append(f'</g><g fill="{TEXT}">')
    out.extend(
        f'<text x="{t.x:.1f}" y="{t.y:.1f}" text-anchor="{t.anchor}">{escape(t.text)}</text>'
        for t in chart.texts
    )
    out.append("</g></svg>")
    return mark_safe("".join(out))  # noqa: S308 (every text above is escaped)


def render_table(chart: Chart) -> SafeString:
    """The chart's figures as a ``<table>``: a header per column, each row's first cell
    its header; every text escaped. (Written here rather than in a template: a year of
    a page of TPU VMs is a thousand cells.)"""
    cid = escape(chart.id)
    head = "".join(f'<th scope="col">{escape(cell)}</th>' for cell in chart.head)
    body = "".join(
        f'<tr><th scope="row">{escape(row[0])}</th>'
        + "".join(f"<td>{escape(cell)}</td>" for cell in row[1:])
        + "</tr>"
        for row in chart.rows
    )
    return mark_safe(  # noqa: S308 (every text above is escaped)
        f'<table id="{cid}-table"><caption class="visually-hidden">{escape(chart.title)}'
        f"</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


# --- the usage page's charts -----------------------------------------------------------


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
    workers: dict[int, int]
    lengths: dict[dt.date, dt.timedelta]
    waits: dict[dt.date, usage.Waits]


def read_series(figures: usage.Usage, vm_rows: list[dict], *, everyone: bool) -> UsageSeries:
    """The series of ``figures``' period: the most used people's worker-time per day,
    that of the TPU VMs of ``vm_rows`` (a page of ``usage.MostUsedFirst``, named; its
    first ``HELD_VMS``) and their workers, and the waits. Six queries at most, four of
    them kept in the cache until more jobs are counted."""
    period = figures.period
    bars = bins(period.first, period.last)
    top = usage.name_people(figures.ranked("user", 0, TOP_PEOPLE))
    people = [(row["id"], row["username"] or row["email"]) for row in top]
    vms = [(row["id"], row["vm_name"]) for row in vm_rows[:HELD_VMS]]
    return UsageSeries(
        bars=bars,
        everyone=everyone,
        people=people,
        people_days=figures.per_day("user", [ident for ident, _ in people]),
        vms=vms,
        more_vms=len(vm_rows) > HELD_VMS,
        vm_days=figures.per_day("vm", [ident for ident, _ in vms]),
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

"""Charts drawn on the server as inline SVG, for pages without a script to build
them: bars over days (``bins``), stacked or in rows, from series to the shapes to draw
(``Chart``, in a drawing's own units: a viewBox, so it scales to its box, text and
all) and the rows of a table with the same figures; then the SVG and the table,
every text escaped. Each series has a colour with enough contrast on white and a
pattern of its own, so none is told from another by colour alone."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field
from html import escape

from django.utils.safestring import SafeString, mark_safe

WIDTH = 360  # the drawing's width, in its own units
FONT = 12
LEFT = 40  # room for the value axis's labels
RIGHT = 20  # room for half of the last bar's label
TOP = 8
BOTTOM = 22  # room for the labels under the bars
PLOT_HEIGHT = 150
BARS_HEIGHT = TOP + PLOT_HEIGHT + BOTTOM  # a chart of bars over days, whole
DAILY_UP_TO = 62  # a longer period is drawn a week a bar
TEXT = "#5b6577"  # 5.8:1 on white
GRID = "#dde1ea"

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


def bin_word(bars: list[Bin]) -> str:
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


def styled(labels: list[str]) -> list[Series]:
    return [Series(label, *STYLES[n % len(STYLES)]) for n, label in enumerate(labels)]


def scale(top: float, ticks: int = 4, *, whole: bool = False) -> float:
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


def axes(chart: Chart, bars: list[Bin], left: float, top_value: float, step: float) -> float:
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


def stack(
    chart: Chart, bars: list[Bin], values: list[list[float]], *, whole: bool = False
) -> list[float]:
    """One rectangle per series and bar, stacked; returns each bar's total. ``whole``:
    the values count things, so the axis's steps are whole numbers."""
    totals = [sum(v[n] for v in values) for n in range(len(bars))]
    step = scale(max(totals, default=0), whole=whole)
    top_value = step * max(1, math.ceil(max(totals, default=0) / step - 1e-9))
    slot = axes(chart, bars, LEFT, top_value, step)
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

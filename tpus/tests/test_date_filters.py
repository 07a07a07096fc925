"""The long tables' date filters print what Django's ``date`` filter prints."""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from django.template import Context, Template
from django.utils import timezone

from tpus.templatetags.tpus_extras import day, day_time


def _render(text: str, value) -> str:
    return Template("{% load tpus_extras %}" + text).render(Context({"v": value}))


MOMENTS = [
    dt.datetime(2026, 1, 5, 9, 4, tzinfo=dt.UTC),
    dt.datetime(2026, 9, 30, 23, 59, tzinfo=dt.UTC),
    dt.datetime(2026, 12, 31, 22, 30, tzinfo=zoneinfo.ZoneInfo("America/Los_Angeles")),
]


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("zone", ["UTC", "Asia/Tokyo"])
def test_they_match_djangos_date_filter_in_the_current_time_zone(moment, zone):
    with timezone.override(zoneinfo.ZoneInfo(zone)):
        assert _render("{{ v|day }}", moment) == _render('{{ v|date:"j M Y" }}', moment)
        assert _render("{{ v|day_time }}", moment) == _render('{{ v|date:"j M Y H:i" }}', moment)
        # Called from Python too: in the current time zone.
        assert day_time(moment) == _render('{{ v|date:"j M Y H:i" }}', moment)


def test_a_plain_date_and_no_date():
    assert _render("{{ v|day }}", dt.date(2026, 3, 7)) == "7 Mar 2026"
    assert _render('{{ v|date:"j M Y" }}', dt.date(2026, 3, 7)) == "7 Mar 2026"
    assert day_time(dt.date(2026, 3, 7)) == "7 Mar 2026"
    assert day(None) == day_time(None) == day("") == ""

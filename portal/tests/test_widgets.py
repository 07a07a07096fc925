"""The portal's own widgets draw what Django's draw."""

from __future__ import annotations

import re

import pytest
from django import forms

from portal.widgets import PlainSelect

CHOICES = [("", "Any"), ("a&b", "A <and> B"), ("READY", "Ready"), (3, "Three")]


def _squeezed(html: str) -> str:
    return re.sub(r">\s+<", "><", str(html)).strip()


@pytest.mark.parametrize("value", [None, "", "READY", "a&b", 3, "3", "stale"])
@pytest.mark.parametrize("attrs", [None, {"id": "id_state", "required": True, "disabled": False}])
def test_a_plain_select_draws_what_djangos_select_draws(value, attrs):
    ours = PlainSelect(choices=CHOICES).render("state", value, attrs)
    django = forms.Select(choices=CHOICES).render("state", value, attrs)
    assert _squeezed(ours) == _squeezed(django)


def test_a_plain_select_marks_one_option_when_a_value_is_listed_twice():
    html = PlainSelect(choices=[("x", "First"), ("x", "Second")]).render("f", "x")
    assert html.count(" selected") == 1
    assert '<option value="x" selected>First</option>' in html


def test_grouped_choices_are_drawn_by_django():
    choices = [("Zones", [("a", "A"), ("b", "B")]), ("c", "C")]
    ours = PlainSelect(choices=choices).render("zone", "b")
    assert ours == forms.Select(choices=choices).render("zone", "b")
    assert "<optgroup" in ours


def test_a_form_field_shows_its_choice_through_a_plain_select():
    class Filters(forms.Form):
        state = forms.ChoiceField(
            required=False, choices=[("", "Any"), ("on", "On")], widget=PlainSelect
        )

    html = str(Filters({"state": "on"})["state"])
    assert html == (
        '<select name="state" id="id_state"><option value="">Any</option>'
        '<option value="on" selected>On</option></select>'
    )

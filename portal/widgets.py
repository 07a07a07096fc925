"""Form widgets of the portal's own."""

from __future__ import annotations

from django import forms
from django.forms.utils import flatatt
from django.utils.html import format_html, format_html_join


class PlainSelect(forms.Select):
    """A ``<select>`` of plain (value, label) choices, written out in Python. Django
    draws each option through two templates, about 40 µs an option, which the
    filter bars above long lists paid on every request. Grouped choices fall back to
    Django's templates."""

    def render(self, name, value, attrs=None, renderer=None):
        if any(isinstance(label, (list, tuple)) for _, label in self.choices):
            return super().render(name, value, attrs, renderer)
        return format_html(
            '<select name="{}"{}>{}</select>',
            name,
            flatatt(self.build_attrs(self.attrs, attrs)),
            format_html_join("", '<option value="{}"{}>{}</option>', self._options(value)),
        )

    def _options(self, value):
        chosen = set(self.format_value(value))
        for option_value, label in self.choices:
            option_value = "" if option_value is None else str(option_value)
            selected = option_value in chosen
            if selected:  # one option selected at most, as Django's Select marks them
                chosen = set()
            yield option_value, " selected" if selected else "", label

"""The pages' own Django forms, run on API input: the page and the API refuse the same
input with the same words. A refusal is a 400 whose ``errors`` lists the messages per
field (``__all__`` for one about the input as a whole), and whose ``detail`` says them
all in one line. A body of the wrong JSON shape never reaches a form: django-ninja
answers it with a 422 that names the field in ``loc``."""

from __future__ import annotations

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS
from ninja import Schema, Status
from pydantic import ConfigDict

from portal.schemas import Error


class FormError(Error):
    """A refusal: ``detail`` for people, and the messages per field of the input."""

    errors: dict[str, list[str]] = {}


class StrictIn(Schema):
    """An input body that refuses fields it does not know (a 422), so a misspelt field
    is not quietly left out of a change."""

    model_config = ConfigDict(extra="forbid")


def refused(form: forms.Form) -> Status:
    """The 400 for a bound form that did not validate."""
    errors = {field: list(messages) for field, messages in form.errors.items()}
    said = [
        message if field == NON_FIELD_ERRORS else f"{field}: {message}"
        for field, messages in errors.items()
        for message in messages
    ]
    return Status(400, {"detail": " ".join(said), "errors": errors})


def refusal(message: str) -> Status:
    """The 400 for a service's refusal of input the form accepted."""
    return Status(400, {"detail": message, "errors": {}})

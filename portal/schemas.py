"""Pieces shared by the API's input schemas."""

from typing import Annotated

from django.core.exceptions import ValidationError
from ninja import Schema
from pydantic import AfterValidator, StringConstraints

from portal.validators import validate_multiline_text, validate_plain_text


def _pydantic(validator):
    def check(value: str) -> str:
        try:
            validator(value)
        except ValidationError as exc:
            raise ValueError(exc.messages[0]) from None
        return value

    return check


def PlainText(max_length: int, min_length: int = 0):
    """One line of text without control characters."""
    return Annotated[
        str,
        StringConstraints(strip_whitespace=True, min_length=min_length, max_length=max_length),
        AfterValidator(_pydantic(validate_plain_text)),
    ]


def MultilineText(max_length: int, min_length: int = 0):
    """Text that may span lines, without other control characters."""
    return Annotated[
        str,
        StringConstraints(strip_whitespace=True, min_length=min_length, max_length=max_length),
        AfterValidator(_pydantic(validate_multiline_text)),
    ]


class Error(Schema):
    """Every refusal the API gives: a sentence for people."""

    detail: str

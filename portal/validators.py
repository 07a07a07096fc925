"""Validators shared by every form and API schema that takes text from people."""

import unicodedata

from django.core.exceptions import ValidationError


def validate_plain_text(value: str) -> None:
    """Refuse control characters (including newlines and bidi overrides) in one-line
    text: names and labels end up in emails, logs and audit records."""
    for char in value:
        if unicodedata.category(char) in {"Cc", "Cf", "Zl", "Zp"}:
            raise ValidationError(
                "Control characters (U+%(code)04X) are not allowed here.",
                code="control_character",
                params={"code": ord(char)},
            )


def validate_multiline_text(value: str) -> None:
    """Like ``validate_plain_text`` but lets ordinary line breaks and tabs through."""
    for char in value:
        if char in "\n\r\t":
            continue
        if unicodedata.category(char) in {"Cc", "Cf", "Zl", "Zp"}:
            raise ValidationError(
                "Control characters (U+%(code)04X) are not allowed here.",
                code="control_character",
                params={"code": ord(char)},
            )

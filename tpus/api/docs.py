"""Words the lab lists share in their OpenAPI descriptions: what each filter means."""

from __future__ import annotations

from django.db.models import TextChoices

from portal.pagination import PAGED  # noqa: F401  (the lists' shared description)

_HELP = {
    "state": "Only rows in this state: {choices}.",
    "role": "Only members with this role: {choices}.",
    "user": "Only this person: their email or unix username (a member, or former member, "
    "of the lab).",
    "vm": "Only this TPU VM of the lab: its id or its name.",
    "zone": "Only TPU VMs in this zone (one of the lab's).",
    "updated_since": "Only rows that changed at or after this ISO 8601 time, e.g. "
    "`2025-06-01T12:00:00Z` (UTC when no offset is given).",
}


def filter_help(name: str, choices: type[TextChoices] | None = None) -> str:
    text = _HELP[name]
    return text.format(choices=", ".join(choices.values)) if choices else text

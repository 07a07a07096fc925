import base64
import binascii
import datetime as dt

from django import template
from django.urls import reverse
from django.utils import timezone

from accounts.sshkeys import fingerprint_sha256
from tpus.models.grants import GrantState
from tpus.models.inventory import HostKeySource, NodeHealth, NodeState
from tpus.models.jobs import JobState
from tpus.models.labs import MembershipState, Role

register = template.Library()


@register.filter
def host_key_fingerprint(line: str) -> str:
    """``"ssh-ed25519 AAAA…"`` → ``"ssh-ed25519 SHA256:…"``, as ssh prints it."""
    key_type, _, blob = line.partition(" ")
    try:
        return f"{key_type} {fingerprint_sha256(base64.b64decode(blob, validate=True))}"
    except (binascii.Error, ValueError):
        return f"{key_type} (unreadable)"


@register.simple_tag(takes_context=True)
def query_with(context, key: str, value) -> str:
    """The current query string with ``key`` set to ``value`` (removed when empty), so
    paging links keep the search and filters: ``?{% query_with "page" 2 %}``."""
    query = context["request"].GET.copy()
    if value in (None, ""):
        query.pop(key, None)
    else:
        query[key] = value
    return query.urlencode()


# Any number the URL patterns' ``<int:pk>`` takes; only its digits are looked for.
_SOME_PK = 7_654_321


@register.simple_tag
def row_url(viewname: str, *args) -> tuple[str, str]:
    """The URL of ``viewname`` for ``args`` and a row's primary key, made once for a
    table: ``{% row_url "vm_detail" lab.slug as vm_url %}``, then
    ``{{ vm_url|with_pk:vm.pk }}`` in each row. ``{% url %}`` runs reverse() for
    every row, about 10 µs each, which a long table pays on every request."""
    head, _, tail = reverse(viewname, args=[*args, _SOME_PK]).rpartition(str(_SOME_PK))
    return head, tail


@register.filter
def with_pk(url: tuple[str, str], pk) -> str:
    """A ``row_url`` for the row whose primary key is ``pk``."""
    head, tail = url
    return f"{head}{pk}{tail}"


# The choice fields long tables show, by the names their rows give them.
_LABELS = {
    "role": dict(Role.choices),
    "membership_state": dict(MembershipState.choices),
    "node_state": dict(NodeState.choices),
    "node_health": dict(NodeHealth.choices),
    "grant_state": dict(GrantState.choices),
    "job_state": dict(JobState.choices),
    "host_keys_source": dict(HostKeySource.choices),
}


@register.filter
def label(value, choices: str) -> str:
    """What ``get_FOO_display()`` shows for ``value``: ``{{ vm.state|label:"node_state" }}``.
    It works on rows read with ``values()`` too, and costs less: Django's method
    builds the choices into a dict on every call (about 5 µs), which a long table
    pays twice a row. A value outside the choices shows as itself, as there."""
    return _LABELS[choices].get(value, value)


# The portal speaks English; Django's ``date`` filter looks each month name up through
# the translation machinery, about 0.1 ms a call, which long tables pay for every row.
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _local(value):
    """An aware time in the current time zone. The filters convert here rather than
    asking the template to (``expects_localtime``), which would convert each value
    twice."""
    if isinstance(value, dt.datetime) and timezone.is_aware(value):
        return timezone.localtime(value)
    return value


@register.filter
def day(value) -> str:
    """``date:"j M Y"`` (24 Nov 2026) for long tables; "" for no date."""
    if not isinstance(value, dt.date):
        return ""
    value = _local(value)
    return f"{value.day} {_MONTHS[value.month - 1]} {value.year}"


@register.filter
def day_time(value) -> str:
    """``date:"j M Y H:i"`` (24 Nov 2026 09:05) for long tables; "" for no time."""
    if not isinstance(value, dt.datetime):
        return day(value)
    value = _local(value)
    return f"{value.day} {_MONTHS[value.month - 1]} {value.year} {value:%H:%M}"

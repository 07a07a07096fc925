import base64
import binascii

from django import template

from accounts.sshkeys import fingerprint_sha256

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

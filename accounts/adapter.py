"""Hooks into django-allauth's flows."""

import time
from types import SimpleNamespace
from urllib.parse import urlsplit

from allauth.account.adapter import DefaultAccountAdapter
from allauth.account.internal.flows.login import AUTHENTICATION_METHODS_SESSION_KEY
from allauth.core import context as allauth_context
from django.conf import settings
from django.core.exceptions import PermissionDenied

from portal import mail
from portal.addresses import client_ip

# A password typed this recently counts as confirming it again: setting up two-factor
# right after signing in does not ask for the password a second time.
FRESH_PASSWORD_SECONDS = 60


class AccountAdapter(DefaultAccountAdapter):
    def login(self, request, user) -> None:
        super().login(request, user)
        _password_just_typed_counts_as_reauthentication(request)
        from accounts.services import record_login

        record_login(request, user)

    def get_client_ip(self, request) -> str:
        """allauth's rate limits count per client address as the rest of the portal
        sees it: behind ``PORTAL_TRUSTED_PROXIES``, the address they forwarded."""
        address = client_ip(request)
        if not address:
            raise PermissionDenied("The address this request came from is unknown.")
        return address

    def send_mail(self, template_prefix: str, email: str, context: dict) -> None:
        """allauth's messages (address verification, password reset, notices) go
        through the portal's outbox like every other email, so an SMTP outage delays
        them instead of losing them or failing the page."""
        request = allauth_context.request
        ctx = {"request": request, "email": email, "current_site": portal_site()}
        ctx.update(context)
        mail.send_message(template_prefix, self.render_mail(template_prefix, email, ctx))


def portal_site() -> SimpleNamespace:
    """What allauth's messages call the site ("Hello from TPU Portal!"): the portal's
    name and the host of ``SITE_URL``, not whatever host the request came in on."""
    domain = urlsplit(settings.SITE_URL).netloc
    return SimpleNamespace(name=settings.PORTAL_SITE_NAME, domain=domain)


def _password_just_typed_counts_as_reauthentication(request) -> None:
    records = request.session.get(AUTHENTICATION_METHODS_SESSION_KEY)
    if not isinstance(records, list) or not records:
        return
    last = records[-1]
    if (
        last.get("method") == "password"
        and time.time() - last.get("at", 0) < FRESH_PASSWORD_SECONDS
    ):
        last["reauthenticated"] = True
        request.session[AUTHENTICATION_METHODS_SESSION_KEY] = records

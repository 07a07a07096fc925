"""Signing in a command-line client through the browser (the OAuth 2.0 device flow,
RFC 8628, as ``gh auth login`` does it).

1. The client asks for a code (``start``): it gets a secret ``device_code`` to poll
   with and a short ``user_code`` to show the person, with the device page's link.
2. The person, signed in on the portal, opens the link, sees the device's name, where
   and when it asked, and approves it by confirming their password, or a code from
   their authenticator app when they have one (``approve``), or denies it (``deny``).
   Wrong codes (per person and per client address) and wrong confirmations (allauth's
   failed sign-ins) are limited in allauth's rate limits; past a limit nothing is
   looked up or checked.
3. The client polls (``poll``) no faster than ``interval`` and receives a personal
   access token of that person, once, with the lifetime of the person's labs; the
   person is emailed that it was made. Until then the client is told why not, in
   RFC 8628's words: ``authorization_pending``, ``slow_down``, ``access_denied``,
   ``expired_token``.

Codes live ``LIFETIME``; rows a day past their end are deleted when new codes are made.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass

from allauth.account.adapter import get_adapter as get_account_adapter
from allauth.core.internal import ratelimit
from allauth.mfa.base.internal.flows import check_rate_limit as check_mfa_rate_limit
from allauth.mfa.models import Authenticator
from allauth.mfa.totp.internal.auth import TOTP
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiToken, DeviceAuthorization, User, hash_token
from accounts.services import MAX_ACTIVE_TOKENS, TokenError, create_token
from portal import mail
from portal.addresses import client_ip
from portal.validators import validate_plain_text

LIFETIME = dt.timedelta(minutes=10)
INTERVAL = 5  # seconds between polls, as RFC 8628 suggests
SLOW_DOWN_STEP = 5
# Letters only, no vowels (no words) and none that read alike: 20^8 codes.
ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
CODE_LENGTH = 8
DEVICE_NAME_MAX = 100
# allauth's rate limits (ACCOUNT_RATE_LIMITS in settings): codes asked for per client
# address, and wrong codes typed per person and per client address.
CODE_REQUESTS = "device_code_request"
WRONG_CODES = "device_code_wrong"


class DeviceFlowError(Exception):
    """What a poll is told instead of a token: ``code`` is RFC 8628's error name."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code
        self.detail = detail


class DeviceCodeRefused(ValueError):
    """A code the device page cannot act on, with the sentence to show."""


@dataclass(frozen=True)
class Started:
    authorization: DeviceAuthorization
    device_code: str


@dataclass(frozen=True)
class Issued:
    token: ApiToken
    raw: str
    user: User


def clean_device_name(name: str) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError("Name the device, such as the computer's host name.")
    if len(name) > DEVICE_NAME_MAX:
        raise ValidationError(f"A device name is at most {DEVICE_NAME_MAX} characters.")
    validate_plain_text(name)
    return name


def normalise_user_code(text: str) -> str:
    """What a person typed (any case, with or without the dash or spaces) as stored."""
    return "".join(ch for ch in (text or "").upper() if ch.isalnum())


def _within_limit(request, action: str, *, user=None, record: bool = True) -> bool:
    """Count one more ``action`` in allauth's rate limits (in the shared cache), or with
    ``record`` False only look: False once one of its rates is used up. GETs count too:
    the device page looks a code up from its link."""
    return bool(
        ratelimit.consume(
            request,
            app="allauth.account",
            action=action,
            user=user,
            dry_run=not record,
            limit_get=True,
        )
    )


def start(device_name: str, *, request) -> Started:
    """A new pending authorization, noting the client's address. Raises
    ValidationError for a bad name or when this address asked for too many codes
    lately."""
    name = clean_device_name(device_name)
    if not _within_limit(request, CODE_REQUESTS):
        raise ValidationError("Too many sign-in codes from this address; wait ten minutes.")
    address = client_ip(request)
    now = timezone.now()
    DeviceAuthorization.objects.filter(expires_at__lt=now - dt.timedelta(days=1)).delete()
    for _ in range(5):
        device_code = secrets.token_urlsafe(32)
        user_code = "".join(secrets.choice(ALPHABET) for _ in range(CODE_LENGTH))
        try:
            with transaction.atomic():
                row = DeviceAuthorization.objects.create(
                    device_digest=hash_token(device_code),
                    user_code=user_code,
                    device_name=name,
                    requested_from=address,
                    created_at=now,
                    expires_at=now + LIFETIME,
                    interval=INTERVAL,
                )
        except IntegrityError:  # a user code still in the table: draw again
            continue
        return Started(row, device_code)
    raise RuntimeError("could not draw a free user code")


def find_for_approval(request, typed: str) -> DeviceAuthorization:
    """The pending authorization the signed-in person typed the code of, or
    DeviceCodeRefused with why not. Wrong codes count against the person and against
    the address they come from; past either limit every code is refused, the right
    one too, so codes cannot be guessed here."""
    user = request.user
    if not _within_limit(request, WRONG_CODES, user=user, record=False):
        raise DeviceCodeRefused(
            "Too many wrong codes from your account or from this address; every code is "
            "refused for now. Wait ten minutes and try again."
        )
    code = normalise_user_code(typed)
    row = None
    if len(code) == CODE_LENGTH:
        row = DeviceAuthorization.objects.filter(user_code=code).first()
    if row is None:
        _within_limit(request, WRONG_CODES, user=user)
        raise DeviceCodeRefused(
            "No device is waiting with that code. Check it against the one your terminal "
            "shows (eight letters, such as WDJB-MJHT)."
        )
    if row.is_expired:
        raise DeviceCodeRefused(
            "That code has expired (codes last ten minutes). Run the sign-in again in your "
            "terminal for a new one."
        )
    if row.state != DeviceAuthorization.State.PENDING:
        raise DeviceCodeRefused("That code has already been used.")
    return row


def totp_of(user: User) -> Authenticator | None:
    """The person's authenticator app, when they set one up."""
    return Authenticator.objects.filter(user=user, type=Authenticator.Type.TOTP).first()


TOO_MANY_CONFIRMATIONS = (
    "Too many wrong confirmations; nothing more is checked for a few minutes. Wait and try again."
)


def check_confirmation(request, *, password: str = "", totp_code: str = "") -> None:
    """The signed-in person proves it is them, as the site requires for a new
    credential: a code from their authenticator app when they have one, else their
    password. Both are throttled by allauth's own failed-login limits, in the same
    counts as its sign-in and two-factor forms, so this page is no way around them."""
    user = request.user
    authenticator = totp_of(user)
    if authenticator is not None:
        try:
            clear_limit = check_mfa_rate_limit(user)
        except ValidationError:
            raise ValidationError(TOO_MANY_CONFIRMATIONS) from None
        if not totp_code.strip() or not TOTP(authenticator).validate_code(totp_code.strip()):
            raise ValidationError("That is not the current code from your authenticator app.")
        clear_limit()
        return
    if not user.has_usable_password():
        raise ValidationError("Set a password for your account first (Account settings).")
    try:
        # allauth counts the attempt (per address and per email address) and takes it
        # back when the password is right, as its sign-in form does.
        confirmed = get_account_adapter(request).authenticate(
            request, email=user.email, password=password
        )
    except ValidationError:
        raise ValidationError(TOO_MANY_CONFIRMATIONS) from None
    if confirmed is None or confirmed.pk != user.pk:
        raise ValidationError("That is not your password.")


def approve(request, row: DeviceAuthorization, *, password: str = "", totp_code: str = ""):
    """Give the waiting device a token of the signed-in person (it collects it on its
    next poll). Raises ValidationError when the confirmation fails or the person cannot
    have another token; DeviceCodeRefused when the code was used or expired meanwhile."""
    user = request.user
    check_confirmation(request, password=password, totp_code=totp_code)
    if user.api_tokens.live().count() >= MAX_ACTIVE_TOKENS:
        raise ValidationError(
            f"You already have {MAX_ACTIVE_TOKENS} API tokens; revoke one on the API tokens "
            "page first."
        )
    _decide(user, row, DeviceAuthorization.State.APPROVED)


def deny(user: User, row: DeviceAuthorization) -> None:
    _decide(user, row, DeviceAuthorization.State.DENIED)


def _decide(user: User, row: DeviceAuthorization, state: str) -> None:
    updated = DeviceAuthorization.objects.filter(
        pk=row.pk, state=DeviceAuthorization.State.PENDING, expires_at__gt=timezone.now()
    ).update(state=state, user=user, decided_at=timezone.now())
    if not updated:
        raise DeviceCodeRefused("That code has already been used or has expired.")


def poll(device_code: str, *, request=None) -> Issued:
    """The token for ``device_code`` once approved (only once), else DeviceFlowError."""
    if not device_code or len(device_code) > 100:
        raise DeviceFlowError("invalid_request", "Give the device_code the portal gave you.")
    now = timezone.now()
    # Decided inside the transaction, raised after it, so what a refused poll records
    # (when it came, a longer interval) is kept.
    with transaction.atomic():
        row = (
            DeviceAuthorization.objects.select_for_update(of=("self",))
            .select_related("user")
            .filter(device_digest=hash_token(device_code))
            .first()
        )
        refusal = _refusal(row, now)
        if row is not None and refusal is None:
            try:
                token, raw = create_token(row.user, row.device_name, request)
            except TokenError as exc:
                refusal = DeviceFlowError("access_denied", str(exc))
            else:
                row.state = DeviceAuthorization.State.ISSUED
                row.token = token
                _tell_owner(row, token)
        if row is not None:
            row.last_polled_at = now
            row.save(update_fields=["last_polled_at", "interval", "state", "token"])
    if refusal is not None:
        raise refusal
    return Issued(token, raw, row.user)


def _tell_owner(row: DeviceAuthorization, token: ApiToken) -> None:
    """Email the person that a device now holds a token of theirs, in the transaction
    that makes it: a sign-in they did not mean is seen, and revoked, at once."""
    mail.send(
        "device_token_created",
        [row.user.email],
        {
            "device_name": row.device_name,
            "token": token,
            "requested_at": row.created_at,
            "requested_from": row.requested_from,
            "url": reverse("token_list"),
        },
    )


def _refusal(row: DeviceAuthorization | None, now) -> DeviceFlowError | None:
    """Why this poll gets no token (None: it gets one). A poll that came too soon also
    lengthens the interval the client must keep."""
    if row is None:
        return DeviceFlowError("expired_token", "This sign-in is unknown or over; start again.")
    if row.state == DeviceAuthorization.State.ISSUED:
        return DeviceFlowError("expired_token", "This sign-in has given its token already.")
    if row.state == DeviceAuthorization.State.DENIED:
        return DeviceFlowError("access_denied", "The sign-in was denied on the portal.")
    if now >= row.expires_at:
        return DeviceFlowError("expired_token", "The code expired before it was approved.")
    if row.last_polled_at is not None and (now - row.last_polled_at).total_seconds() < row.interval:
        row.interval += SLOW_DOWN_STEP
        return DeviceFlowError(
            "slow_down", f"Polling too fast: wait {row.interval} seconds between polls."
        )
    if row.state == DeviceAuthorization.State.PENDING:
        return DeviceFlowError(
            "authorization_pending", "Waiting for the code to be approved on the portal."
        )
    if row.user is None or not row.user.is_active:
        return DeviceFlowError("access_denied", "The account that approved it is disabled.")
    return None

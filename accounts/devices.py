"""Signing in a command-line client through the browser (the OAuth 2.0 device flow,
RFC 8628, as ``gh auth login`` does it).

1. The client asks for a code (``start``): it gets a secret ``device_code`` to poll
   with and a short ``user_code`` to show the person, with the device page's link.
2. The person, signed in on the portal, opens the link, sees the device's name, where
   and when it asked, and approves it by confirming their password, or a code from
   their authenticator app when they have one (``approve``), or denies it (``deny``).
3. The client polls (``poll``) no faster than ``interval`` and receives a personal
   access token of that person, once. Until then it is told why not, in RFC 8628's
   words: ``authorization_pending``, ``slow_down``, ``access_denied``,
   ``expired_token``.

Codes live ``LIFETIME``; rows a day past their end are deleted when new codes are made.
"""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass

from allauth.mfa.models import Authenticator
from allauth.mfa.totp.internal.auth import TOTP
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import ApiToken, DeviceAuthorization, User, hash_token
from accounts.services import MAX_ACTIVE_TOKENS, TokenError, create_token
from portal.validators import validate_plain_text

LIFETIME = dt.timedelta(minutes=10)
INTERVAL = 5  # seconds between polls, as RFC 8628 suggests
SLOW_DOWN_STEP = 5
# Letters only, no vowels (no words) and none that read alike: 20^8 codes.
ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"
CODE_LENGTH = 8
# Per client address: codes asked for, and per person: wrong codes typed, in 10 minutes.
MAX_CODES_PER_ADDRESS = 30
MAX_WRONG_CODES_PER_PERSON = 10
WINDOW_SECONDS = 600
DEVICE_NAME_MAX = 100


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


def _over_limit(key: str, limit: int) -> bool:
    """Count one more in the shared cache; True once ``limit`` is passed this window."""
    cache.add(key, 0, timeout=WINDOW_SECONDS)
    try:
        return cache.incr(key) > limit
    except ValueError:  # expired between add and incr
        cache.set(key, 1, timeout=WINDOW_SECONDS)
        return False


def start(device_name: str, *, address: str | None) -> Started:
    """A new pending authorization. Raises ValidationError for a bad name or when this
    address asked for too many codes lately."""
    name = clean_device_name(device_name)
    if address and _over_limit(f"device-codes:{address}", MAX_CODES_PER_ADDRESS):
        raise ValidationError("Too many sign-in codes from this address; wait ten minutes.")
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


def find_for_approval(user: User, typed: str) -> DeviceAuthorization:
    """The pending authorization a person typed the code of, or DeviceCodeRefused with
    why not. Wrong codes count against the person, so codes cannot be guessed here."""
    code = normalise_user_code(typed)
    row = None
    if len(code) == CODE_LENGTH:
        row = DeviceAuthorization.objects.filter(user_code=code).first()
    if row is None:
        if _over_limit(f"device-wrong:{user.pk}", MAX_WRONG_CODES_PER_PERSON):
            raise DeviceCodeRefused("Too many wrong codes; wait ten minutes and try again.")
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


def check_confirmation(user: User, *, password: str = "", totp_code: str = "") -> None:
    """The person proves it is them, as the site requires for a new credential: a code
    from their authenticator app when they have one, else their password."""
    authenticator = totp_of(user)
    if authenticator is not None:
        if not totp_code.strip() or not TOTP(authenticator).validate_code(totp_code.strip()):
            raise ValidationError("That is not the current code from your authenticator app.")
        return
    if not user.has_usable_password():
        raise ValidationError("Set a password for your account first (Account settings).")
    if not password or not user.check_password(password):
        raise ValidationError("That is not your password.")


def approve(user: User, row: DeviceAuthorization, *, password: str = "", totp_code: str = ""):
    """Give the waiting device a token of ``user`` (it collects it on its next poll).
    Raises ValidationError when the confirmation fails or the person cannot have
    another token; DeviceCodeRefused when the code was used or expired meanwhile."""
    check_confirmation(user, password=password, totp_code=totp_code)
    if user.api_tokens.filter(revoked_at=None).count() >= MAX_ACTIVE_TOKENS:
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
        if row is not None:
            row.last_polled_at = now
            row.save(update_fields=["last_polled_at", "interval", "state", "token"])
    if refusal is not None:
        raise refusal
    return Issued(token, raw, row.user)


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

"""Use cases about people and their credentials."""

from __future__ import annotations

import datetime as dt

from allauth.mfa.models import Authenticator
from django.conf import settings
from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from accounts.models import ApiToken, User, hash_token
from portal.validators import validate_plain_text


def is_admin(user: User) -> bool:
    """Site admins and lab admins: the people whose sign-in guards other people."""
    from tpus.access import administers_any_lab

    return user.is_site_admin or administers_any_lab(user)


def needs_mfa_enrolment(user: User) -> bool:
    if not is_admin(user):
        return False
    return not Authenticator.objects.filter(user=user, type=Authenticator.Type.TOTP).exists()


def record_login(request, user: User) -> None:
    """Admins' sign-ins go to the audit log of every lab they run."""
    from portal import audit
    from portal.audit import AuditAction
    from tpus.access import admin_labs

    if not is_admin(user):
        return
    labs = [None] if user.is_site_admin else list(admin_labs(user))
    for lab in labs:
        audit.record(AuditAction.ADMIN_LOGIN, actor=user, lab=lab, request=request)


class TokenError(ValueError):
    """A token could not be made as asked; the message says why."""


MAX_ACTIVE_TOKENS = 20


@transaction.atomic
def create_token(user: User, name: str, request=None) -> tuple[ApiToken, str]:
    """Make a personal access token. Returns the row and the token itself, which is
    never stored and cannot be shown again."""
    from django.core.exceptions import ValidationError

    from portal import audit
    from portal.audit import AuditAction

    name = (name or "").strip()
    if not name:
        raise TokenError("Give the token a name, such as the machine that will use it.")
    if len(name) > 100:
        raise TokenError("A token name can be at most 100 characters.")
    try:
        validate_plain_text(name)
    except ValidationError as exc:
        raise TokenError(exc.messages[0]) from None
    User.objects.select_for_update().filter(pk=user.pk).first()  # serialise per user
    if user.api_tokens.live().count() >= MAX_ACTIVE_TOKENS:
        raise TokenError(f"You already have {MAX_ACTIVE_TOKENS} tokens; revoke one first.")
    raw = ApiToken.generate()
    now = timezone.now()
    token = ApiToken.objects.create(
        user=user,
        name=name,
        hint=raw[: len("tpp_") + 6],
        digest=hash_token(raw),
        created_at=now,
        expires_at=now + dt.timedelta(days=token_lifetime_days(user)),
    )
    audit.record(
        AuditAction.TOKEN_CREATED, actor=user, target_user=user, summary=name, request=request
    )
    return token, raw


def token_lifetime_days(user: User) -> int:
    """How long a token made now for ``user`` lives: the shortest lifetime of the labs
    it could act in (each lab admin's choice), or the site's for someone in no lab."""
    from tpus.access import member_labs

    shortest = member_labs(user).aggregate(days=Min("token_lifetime_days"))["days"]
    return shortest or settings.PORTAL_TOKEN_LIFETIME_DAYS


def revoke_token(user: User, token: ApiToken, request=None) -> None:
    """Revoke one of the user's tokens; revoking twice is fine."""
    from portal import audit
    from portal.audit import AuditAction

    updated = ApiToken.objects.filter(pk=token.pk, user=user, revoked_at=None).update(
        revoked_at=timezone.now()
    )
    if updated:
        audit.record(
            AuditAction.TOKEN_REVOKED,
            actor=user,
            target_user=user,
            summary=token.name,
            request=request,
        )


class TokenExpired(Exception):
    """A real token whose time is over: the client must sign in again."""

    def __init__(self, expired_at: dt.datetime):
        super().__init__(f"expired at {expired_at.isoformat()}")
        self.expired_at = expired_at


def authenticate_token(raw: str) -> User | None:
    """The active user a bearer token belongs to, or None; TokenExpired for one that
    was good until its expiry, so the client can say why."""
    if not raw or not raw.startswith("tpp_") or len(raw) > 100:
        return None
    token = (
        ApiToken.objects.select_related("user")
        .filter(digest=hash_token(raw), revoked_at=None, user__is_active=True)
        .first()
    )
    if token is None:
        return None
    now = timezone.now()
    if now >= token.expires_at:
        raise TokenExpired(token.expires_at)
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user

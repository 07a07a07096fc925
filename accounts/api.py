"""API endpoints about the signed-in person."""

from datetime import datetime

from django.core.exceptions import ValidationError as DjangoValidationError
from django.urls import reverse
from django.views.decorators.debug import sensitive_variables
from ninja import Router, Schema, Status
from ninja.pagination import paginate
from pydantic import Field

from accounts import devices, keys, services, unix
from accounts.access import get_own_key, get_own_token
from accounts.models import UnixAccount, hash_token
from accounts.sshkeys import KeyRejected
from portal.pagination import PAGED, KeysetPagination
from portal.schemas import Error, PlainText

router = Router(tags=["me"])


class MeOut(Schema):
    id: int
    email: str
    full_name: str
    is_site_admin: bool


class TokenOut(Schema):
    id: int
    name: str
    hint: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime


class TokenIn(Schema):
    name: PlainText(100, min_length=1)


class NewTokenOut(TokenOut):
    token: str


@router.get("/me", response=MeOut, summary="The signed-in person")
def me(request):
    return request.user


@router.get(
    "/tokens",
    response=list[TokenOut],
    summary="My API tokens",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_tokens(request):
    return request.user.api_tokens.all()


@router.post(
    "/tokens",
    response={201: NewTokenOut, 400: Error},
    summary="Create an API token (its value is returned once)",
)
def create_token(request, payload: TokenIn):
    try:
        token, raw = services.create_token(request.user, payload.name, request)
    except services.TokenError as exc:
        return Status(400, {"detail": str(exc)})
    return Status(201, {**TokenOut.from_orm(token).dict(), "token": raw})


@router.delete(
    "/tokens/current",
    response={204: None, 400: Error},
    summary="Revoke the token this request carries (signing a command-line client out)",
)
def revoke_current_token(request):
    raw = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    token = request.user.api_tokens.filter(digest=hash_token(raw)).first() if raw else None
    if token is None:
        return Status(
            400, {"detail": "This request carries no API token (it is a browser session)."}
        )
    services.revoke_token(request.user, token, request)
    return Status(204, None)


@router.delete("/tokens/{token_id}", response={204: None}, summary="Revoke an API token")
def revoke_token(request, token_id: int):
    services.revoke_token(request.user, get_own_token(request.user, token_id), request)
    return Status(204, None)


class Refusal(Schema):
    detail: str
    code: str


class KeyOut(Schema):
    id: int
    label: str
    key_type: str
    algorithm: str
    bits: int
    fingerprint_sha256: str
    comment: str
    created_at: datetime


class KeyIn(Schema):
    # Kept out of the schema's repr: what is sent here can be a private key.
    key: str = Field(
        repr=False,
        description="The public key: the one line of your .pub file (or an RFC 4716 block).",
    )
    label: PlainText(100) = ""


class UnixAccountOut(Schema):
    username: str | None
    uid: int | None
    gid: int | None
    locked: bool
    suggestion: str | None


class UsernameIn(Schema):
    username: str


@router.get(
    "/keys",
    response=list[KeyOut],
    summary="My SSH public keys",
    description=PAGED,
)
@paginate(KeysetPagination)
def list_keys(request):
    return request.user.ssh_keys.all()


@router.post(
    "/keys",
    response={201: KeyOut, 400: Refusal},
    summary="Add an SSH public key (refusals explain themselves, with a stable code)",
)
@sensitive_variables()
def add_key(request, payload: KeyIn):
    try:
        key = keys.add_key(request.user, payload.key, payload.label, request)
    except KeyRejected as exc:
        return Status(400, {"detail": exc.message, "code": exc.code})
    return Status(201, key)


@router.delete("/keys/{key_id}", response={204: None}, summary="Delete an SSH public key")
def delete_key(request, key_id: int):
    keys.delete_key(request.user, get_own_key(request.user, key_id), request)
    return Status(204, None)


def _unix_account_out(user, account: UnixAccount | None) -> dict:
    chosen = account is not None and bool(account.username)
    return {
        "username": (account.username or None) if account else None,
        "uid": account.uid if account else None,
        "gid": account.gid if account else None,
        "locked": account.locked if account else False,
        "suggestion": None if chosen else unix.suggested_username(user),
    }


@router.get("/unix-account", response=UnixAccountOut, summary="My unix username and UID")
def get_unix_account(request):
    account = UnixAccount.objects.filter(user=request.user).first()
    return _unix_account_out(request.user, account)


@router.put(
    "/unix-account",
    response={200: UnixAccountOut, 400: Refusal},
    summary="Choose my unix username (fixed once my account exists on a machine)",
)
def choose_username(request, payload: UsernameIn):
    try:
        account = unix.choose_username(request.user, payload.username, request)
    except unix.UnixAccountError as exc:
        return Status(400, {"detail": exc.message, "code": exc.code})
    return _unix_account_out(request.user, account)


# --- signing in a command-line client through the browser (RFC 8628) ----------------


class DeviceCodeIn(Schema):
    device_name: str = Field(description="What the person will see: the computer's name.")


class DeviceCodeOut(Schema):
    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str
    expires_in: int
    interval: int


class DeviceTokenIn(Schema):
    device_code: str


class DeviceTokenOut(Schema):
    token: str
    email: str
    username: str | None


class DeviceRefusal(Schema):
    error: str
    detail: str


@router.post(
    "/device/codes",
    auth=None,
    response={201: DeviceCodeOut, 400: Error},
    summary="Start signing in a device: a code for the person to approve in the browser",
)
def start_device_login(request, payload: DeviceCodeIn):
    try:
        started = devices.start(payload.device_name, request=request)
    except DjangoValidationError as exc:
        return Status(400, {"detail": " ".join(exc.messages)})
    row = started.authorization
    page = request.build_absolute_uri(reverse("device_login"))
    return Status(
        201,
        {
            "device_code": started.device_code,
            "user_code": row.shown_code,
            "verification_uri": page,
            "verification_uri_complete": f"{page}?code={row.shown_code}",
            "expires_in": int((row.expires_at - row.created_at).total_seconds()),
            "interval": row.interval,
        },
    )


@router.post(
    "/device/token",
    auth=None,
    response={200: DeviceTokenOut, 400: DeviceRefusal},
    summary="Poll for the device's token (once approved, it is returned once)",
    description="Until then 400 with `error`: `authorization_pending` (ask again after "
    "`interval` seconds), `slow_down` (add 5 seconds to the interval), `access_denied`, "
    "`expired_token` (start again).",
)
@sensitive_variables()
def poll_device_login(request, payload: DeviceTokenIn):
    try:
        issued = devices.poll(payload.device_code, request=request)
    except devices.DeviceFlowError as exc:
        return Status(400, {"error": exc.code, "detail": exc.detail})
    account = getattr(issued.user, "unix_account", None)
    return Status(
        200,
        {
            "token": issued.raw,
            "email": issued.user.email,
            "username": account.username if account else None,
        },
    )

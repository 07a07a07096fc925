"""API endpoints about the signed-in person."""

from datetime import datetime

from ninja import Router, Schema, Status

from accounts import services
from accounts.access import get_own_token
from portal.schemas import PlainText

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


class TokenIn(Schema):
    name: PlainText(100, min_length=1)


class NewTokenOut(TokenOut):
    token: str


class Error(Schema):
    detail: str


@router.get("/me", response=MeOut, summary="The signed-in person")
def me(request):
    return request.user


@router.get("/tokens", response=list[TokenOut], summary="My API tokens")
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


@router.delete("/tokens/{token_id}", response={204: None}, summary="Revoke an API token")
def revoke_token(request, token_id: int):
    services.revoke_token(request.user, get_own_token(request.user, token_id), request)
    return Status(204, None)

"""The JSON API under /api/v1/: personal access tokens (``Authorization: Bearer``)
or the browser session (with its CSRF token). Each app adds a router."""

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpRequest
from django.urls import reverse
from ninja import NinjaAPI
from ninja.errors import HttpError
from ninja.security import HttpBearer, SessionAuth

from accounts.services import TokenExpired, authenticate_token, needs_mfa_enrolment


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        user = authenticate_token(token)  # TokenExpired: answered by _token_expired
        if user is None:
            return None
        # A token must not be a way around the two-factor rule the pages enforce.
        if settings.PORTAL_REQUIRE_ADMIN_MFA and needs_mfa_enrolment(user):
            url = request.build_absolute_uri(reverse("mfa_activate_totp"))
            raise HttpError(
                403,
                "Two-factor authentication is required for site and lab admins. "
                f"Set up an authenticator app at {url} and then call the API again.",
            )
        request.user = user
        return user


class ActiveSessionAuth(SessionAuth):
    """The browser session, for people using the API from the portal's own pages."""

    def authenticate(self, request: HttpRequest, key):
        user = super().authenticate(request, key)
        return user if user is not None and user.is_active else None


api = NinjaAPI(
    title="TPU Portal API",
    version="1",
    description="Labs, memberships and TPU access. Authenticate with a personal access "
    "token from the API tokens page: `Authorization: Bearer tpp_…`. Every list answers "
    "one page, `{items, next, total}`: pass `limit` (at most 200) and follow `next` until "
    "it is null; filters narrow a list, and a value a filter cannot match is a 400. "
    "Walking pages with curl, and how a script should pace itself: docs/api.md.",
    auth=[TokenAuth(), ActiveSessionAuth()],
    openapi_url="/openapi.json",
    docs_url="/docs",
    urls_namespace="api",
)


@api.exception_handler(PermissionDenied)
def _forbidden(request, exc):
    """A refusal inside the API is JSON like every other answer, with its reason."""
    detail = str(exc) or "You may not do that."
    return api.create_response(request, {"detail": detail}, status=403)


@api.exception_handler(TokenExpired)
def _token_expired(request, exc):
    """401 with a code a client recognises (``token_expired``) and when it happened, so
    it can tell the person to sign in again rather than that something is broken."""
    when = exc.expired_at.strftime("%Y-%m-%d %H:%M UTC")
    response = api.create_response(
        request,
        {
            "detail": f"This API token expired on {when}. Sign in again (`tpu login`) or "
            "make a new token on the API tokens page.",
            "error": "token_expired",
            "expired_at": exc.expired_at.isoformat(),
        },
        status=401,
    )
    response["WWW-Authenticate"] = 'Bearer error="invalid_token", error_description="expired"'
    return response


@api.exception_handler(DjangoValidationError)
def _invalid(request, exc):
    return api.create_response(request, {"detail": " ".join(exc.messages)}, status=400)


def _register_routers() -> None:
    from accounts.api import router as accounts_router
    from tpus.api.access import router as access_router
    from tpus.api.admin import router as admin_router
    from tpus.api.elastic import router as elastic_router
    from tpus.api.inventory import router as inventory_router
    from tpus.api.jobs import router as jobs_router
    from tpus.api.kind_grants import router as kind_grants_router
    from tpus.api.labs import router as tpus_router
    from tpus.api.pool import router as pool_router
    from tpus.api.provisioning import router as provisioning_router
    from tpus.api.snapshots import router as snapshots_router
    from tpus.api.workers import router as workers_router

    api.add_router("", accounts_router)
    api.add_router("", tpus_router)
    api.add_router("", admin_router)
    api.add_router("", inventory_router)
    api.add_router("", access_router)
    api.add_router("", kind_grants_router)
    api.add_router("", workers_router)
    api.add_router("", jobs_router)
    api.add_router("", pool_router)
    api.add_router("", provisioning_router)
    api.add_router("", snapshots_router)
    api.add_router("", elastic_router)


_register_routers()

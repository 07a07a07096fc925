"""The JSON API under /api/v1/: personal access tokens (``Authorization: Bearer``)
or the browser session (with its CSRF token). Each app adds a router."""

from django.http import HttpRequest
from ninja import NinjaAPI
from ninja.security import HttpBearer, SessionAuth


class TokenAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        from accounts.services import authenticate_token

        user = authenticate_token(token)
        if user is not None:
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
    "token from the API tokens page: `Authorization: Bearer tpp_…`.",
    auth=[TokenAuth(), ActiveSessionAuth()],
    openapi_url="/openapi.json",
    docs_url="/docs",
    urls_namespace="api",
)


def _register_routers() -> None:
    from accounts.api import router as accounts_router
    from tpus.api import router as tpus_router
    from tpus.api_access import router as access_router
    from tpus.api_inventory import router as inventory_router

    api.add_router("", accounts_router)
    api.add_router("", tpus_router)
    api.add_router("", inventory_router)
    api.add_router("", access_router)


_register_routers()

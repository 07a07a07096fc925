from django.contrib import admin
from django.contrib.auth.decorators import login_required
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from accounts.views import device_login
from portal.api import api
from portal.health import healthz
from portal.metrics.views import metrics

# The Django admin signs in through allauth, so admins get rate limits and TOTP there too.
admin.site.login = login_required(admin.site.login)
admin.site.site_header = "TPU Portal site admin"


class FaviconRedirect(RedirectView):
    """Browsers ask for /favicon.ico whatever the page links. The icon's (hashed)
    address is looked up per request: at import time the manifest may not exist yet."""

    permanent = True

    def get_redirect_url(self, *args, **kwargs):
        return static("favicon.svg")


urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("favicon.ico", FaviconRedirect.as_view(), name="favicon"),
    path("", include("tpus.urls")),
    path("account/", include("accounts.urls")),
    # Short, for typing from a terminal: where ``tpu login`` sends people.
    path("device/", device_login, name="device_login"),
    path("accounts/", include("allauth.urls")),
    path("api/v1/", api.urls),
    path("admin/", admin.site.urls),
]

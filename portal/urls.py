from django.contrib import admin
from django.contrib.auth.decorators import login_required
from django.urls import include, path

from portal.api import api

# The Django admin signs in through allauth, so admins get rate limits and TOTP there too.
admin.site.login = login_required(admin.site.login)
admin.site.site_header = "TPU Portal site admin"

urlpatterns = [
    path("", include("tpus.urls")),
    path("account/", include("accounts.urls")),
    path("accounts/", include("allauth.urls")),
    path("api/v1/", api.urls),
    path("admin/", admin.site.urls),
]

"""Site admins and lab admins must protect their sign-in with TOTP."""

from django.conf import settings
from django.shortcuts import redirect
from django.urls import reverse


class RequireAdminMFAMiddleware:
    """With ``PORTAL_REQUIRE_ADMIN_MFA`` on, an admin without an authenticator app is
    sent to set one up before any other page (sign-out and the MFA pages stay open)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if self._must_enrol(request):
            return redirect("mfa_activate_totp")
        # The page that sets the app up says why it is asked for.
        request.admin_mfa_required = request.path == reverse(
            "mfa_activate_totp"
        ) and self._required_for(request.user)
        return self.get_response(request)

    @staticmethod
    def _required_for(user) -> bool:
        if not settings.PORTAL_REQUIRE_ADMIN_MFA or not user.is_authenticated:
            return False
        from accounts.services import needs_mfa_enrolment

        return needs_mfa_enrolment(user)

    def _must_enrol(self, request) -> bool:
        if not settings.PORTAL_REQUIRE_ADMIN_MFA or not request.user.is_authenticated:
            return False
        open_paths = (
            reverse("mfa_index"),
            reverse("account_logout"),
            reverse("account_reauthenticate"),
            settings.STATIC_URL if settings.STATIC_URL.startswith("/") else "/static/",
        )
        if request.path.startswith(open_paths):
            return False
        return self._required_for(request.user)

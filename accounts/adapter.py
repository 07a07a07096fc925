"""Hooks into django-allauth's flows."""

from allauth.account.adapter import DefaultAccountAdapter


class AccountAdapter(DefaultAccountAdapter):
    def login(self, request, user) -> None:
        super().login(request, user)
        from accounts.services import record_login

        record_login(request, user)

"""Scoped lookups for a person's own credentials: someone else's is a 404."""

from django.http import Http404

from accounts.models import ApiToken


def get_own_token(user, token_id: int) -> ApiToken:
    try:
        return user.api_tokens.get(pk=token_id)
    except ApiToken.DoesNotExist:
        raise Http404("No such token.") from None

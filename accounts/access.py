"""Scoped lookups for a person's own credentials: someone else's is a 404."""

from django.http import Http404

from accounts.models import ApiToken, SSHKey


def get_own_token(user, token_id: int) -> ApiToken:
    try:
        return user.api_tokens.get(pk=token_id)
    except ApiToken.DoesNotExist:
        raise Http404("No such token.") from None


def get_own_key(user, key_id: int) -> SSHKey:
    """One of the person's own SSH keys; anyone else's is a 404, like a missing one."""
    try:
        return user.ssh_keys.get(pk=key_id)
    except (SSHKey.DoesNotExist, ValueError, TypeError):
        raise Http404("No such key.") from None

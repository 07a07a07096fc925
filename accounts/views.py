"""Pages about the signed-in person's own credentials."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts import services
from accounts.access import get_own_token
from accounts.forms import TokenForm


@login_required
def token_list(request):
    form = TokenForm(request.POST or None)
    raw = None
    if request.method == "POST" and form.is_valid():
        try:
            _, raw = services.create_token(request.user, form.cleaned_data["name"], request)
        except services.TokenError as exc:
            form.add_error("name", str(exc))
        else:
            form = TokenForm()
    tokens = request.user.api_tokens.all()
    return render(
        request, "accounts/token_list.html", {"form": form, "tokens": tokens, "new_token": raw}
    )


@login_required
@require_POST
def token_revoke(request, token_id):
    token = get_own_token(request.user, token_id)
    services.revoke_token(request.user, token, request)
    messages.success(request, f"Token “{token.name}” no longer works.")
    return redirect("token_list")

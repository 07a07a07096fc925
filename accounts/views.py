"""Pages about the signed-in person's own credentials: API tokens, SSH keys and the
unix account they become on the lab's machines."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.debug import sensitive_post_parameters, sensitive_variables
from django.views.decorators.http import require_POST

from accounts import devices, keys, services, unix
from accounts.access import get_own_key, get_own_token
from accounts.forms import KeyForm, TokenForm, UsernameForm
from accounts.models import UnixAccount
from accounts.sshkeys import KeyRejected
from portal import uploads
from portal.addresses import client_ip


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
    return render(
        request,
        "accounts/token_list.html",
        {
            "form": form,
            "tokens": request.user.api_tokens.all(),
            "new_token": raw,
            "lifetime_days": services.token_lifetime_days(request.user),
        },
    )


@login_required
@require_POST
def token_revoke(request, token_id):
    token = get_own_token(request.user, token_id)
    services.revoke_token(request.user, token, request)
    messages.success(request, f"Token “{token.name}” no longer works.")
    return redirect("token_list")


# What someone pastes here can be a private key: it is kept out of error reports.
@login_required
@sensitive_post_parameters("key_text")
@sensitive_variables()
def key_list(request):
    form = KeyForm(
        request.POST or None,
        request.FILES or None,
        refused_uploads=uploads.refused_uploads(request),
    )
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            key = keys.add_key(request.user, data["key_text"], data["label"], request)
        except KeyRejected as exc:
            form.reject(exc)
        else:
            messages.success(
                request, f"Key added: {key.algorithm} {key.fingerprint_sha256} ({key.name})."
            )
            return redirect("key_list")
    return _key_page(request, key_form=form)


@login_required
def key_delete(request, key_id):
    key = get_own_key(request.user, key_id)
    if request.method == "POST":
        keys.delete_key(request.user, key, request)
        messages.success(request, f"Key “{key.name}” deleted. It no longer opens the lab's VMs.")
        return redirect("key_list")
    return render(request, "accounts/key_delete.html", {"key": key})


@login_required
@require_POST
def unix_username(request):
    form = UsernameForm(request.POST)
    if form.is_valid():
        try:
            account = unix.choose_username(request.user, form.cleaned_data["username"], request)
        except unix.UnixAccountError as exc:
            form.add_error("username", exc.message)
        else:
            messages.success(
                request, f"Your unix username is {account.username} (UID {account.uid})."
            )
            return redirect("key_list")
    return _key_page(request, username_form=form)


def _key_page(request, *, key_form=None, username_form=None):
    user = request.user
    ssh_keys = list(user.ssh_keys.all())
    account = UnixAccount.objects.filter(user=user).first()
    suggestion = None
    if account is None or not account.username:
        suggestion = unix.suggested_username(user)
    if username_form is None:
        initial = account.username if account and account.username else suggestion
        username_form = UsernameForm(initial={"username": initial or ""})
    return render(
        request,
        "accounts/key_list.html",
        {
            "ssh_keys": ssh_keys,
            "key_form": key_form or KeyForm(),
            "account": account,
            "suggestion": suggestion,
            "username_form": username_form,
            "max_keys": keys.MAX_KEYS_PER_USER,
        },
    )


@login_required
@sensitive_post_parameters("password", "totp_code")
def device_login(request):
    """A command-line client's sign-in (``tpu login``): the person types or follows the
    code their terminal shows, sees which device asks, from where and when, and
    approves it by confirming their password (or a code from their authenticator app),
    or denies it. A code typed here is posted; one that arrives in the address (the
    client's link, or anyone's) is warned about, since a link is how someone else's
    sign-in would be slipped to the person."""
    posted = request.method == "POST"
    action = request.POST.get("action", "") if posted else ""
    typed = (request.POST.get("code") if posted else request.GET.get("code")) or ""
    typed = typed.strip()
    from_link = bool(typed) and (not posted or request.POST.get("from_link") == "1")
    context = {
        "code": typed,
        "from_link": from_link,
        "needs_totp": devices.totp_of(request.user) is not None,
        "browser_address": client_ip(request),
    }
    row = None
    if typed:
        try:
            row = devices.find_for_approval(request, typed)
        except devices.DeviceCodeRefused as exc:
            context["code_error"] = str(exc)
    if action in ("approve", "deny") and row is not None:
        try:
            if action == "deny":
                devices.deny(request.user, row)
                context["done"] = "denied"
            else:
                devices.approve(
                    request,
                    row,
                    password=request.POST.get("password", ""),
                    totp_code=request.POST.get("totp_code", ""),
                )
                context["done"] = "approved"
        except ValidationError as exc:
            context["confirm_error"] = exc.messages[0]
        except devices.DeviceCodeRefused as exc:
            context["code_error"] = str(exc)
            row = None
    context["device"] = row
    refused = "code_error" in context or "confirm_error" in context
    status = 400 if posted and (refused or (action and "done" not in context)) else 200
    return render(request, "accounts/device.html", context, status=status)

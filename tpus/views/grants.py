"""Pages for giving and taking access to TPU VMs, with live per-worker progress."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tpus import access
from tpus.forms_grants import GrantForm, MemberGrantForm
from tpus.models.grants import GrantState
from tpus.services import grants as grant_services
from tpus.services.grants import GrantError


def vm_progress_context(vm) -> dict:
    """Grants and each worker's last reconcile, for the VM page and its live part."""
    grants = vm.grants.select_related("user__unix_account").order_by("user__unix_account__username")
    workers = vm.workers.select_related("sync").order_by("index")
    in_flight = any(g.state in (GrantState.PENDING, GrantState.REVOKING) for g in grants)
    return {"vm": vm, "grants": grants, "workers": workers, "in_flight": in_flight}


@login_required
def vm_progress(request, slug, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    return render(request, "tpus/_vm_progress.html", {"lab": lab, **vm_progress_context(vm)})


@login_required
@require_POST
def grant_create(request, slug, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    form = GrantForm(request.POST, lab=lab)
    if not form.is_valid():
        messages.error(request, " ".join(e for errors in form.errors.values() for e in errors))
        return redirect("vm_detail", lab.slug, vm.pk)
    user = form.cleaned_data["user"]
    try:
        grant_services.grant_access(
            request.user,
            lab,
            user,
            [vm],
            sudo=form.cleaned_data["sudo"],
            expires_on=form.cleaned_data["expires_on"],
            request=request,
        )
    except GrantError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Adding {user.unix_account.username} to {vm.name}…")
    return redirect("vm_detail", lab.slug, vm.pk)


@login_required
def member_grant(request, slug, membership_id):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = MemberGrantForm(request.POST or None, lab=lab)
    if request.method == "POST" and form.is_valid():
        try:
            grant_services.grant_access(
                request.user,
                lab,
                membership.user,
                list(form.cleaned_data["vms"]),
                sudo=form.cleaned_data["sudo"],
                expires_on=form.cleaned_data["expires_on"],
                request=request,
            )
        except GrantError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Giving {membership.user.email} access…")
            return redirect("lab_admin", lab.slug)
    grants = membership.user.grants.filter(vm__lab=lab).select_related("vm")
    return render(
        request,
        "tpus/member_grant.html",
        {"lab": lab, "membership": membership, "form": form, "grants": grants},
    )


@login_required
@require_POST
def grant_revoke(request, slug, grant_id):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    grant_services.revoke_access(request.user, grant, request=request)
    messages.success(request, f"Revoking {grant.user.email}'s access to {grant.vm.name}…")
    return redirect("vm_detail", lab.slug, grant.vm_id)


@login_required
@require_POST
def grant_retry(request, slug, grant_id):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    grant_services.retry_grant(request.user, grant, request=request)
    return redirect("vm_detail", lab.slug, grant.vm_id)

"""Pages for TPU VMs the portal makes: ask for one, follow and cancel the requests;
stop, start and delete a VM."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from tpus import access
from tpus.forms.provisioning import VmCreateForm
from tpus.models import Provisioning, VmRequest
from tpus.services import allowances, vm_lifecycle, vm_requests


@login_required
def vm_create(request, slug):
    """The lab's requests for TPU VMs and the form to ask for another."""
    lab = access.get_admin_lab(request.user, slug)
    offered = vm_requests.offered(lab)
    form = VmCreateForm(request.POST or None, lab=lab, offered=offered.zones)
    if request.method == "POST" and form.is_valid():
        try:
            made = vm_requests.request_vm(
                request.user, lab, vm_requests.VmSpec(**form.cleaned_data), request=request
            )
        except ValidationError as exc:
            for field, errors in exc.message_dict.items():
                for error in errors:
                    form.add_error(field if field in form.fields else None, error)
        else:
            messages.success(
                request,
                f"{made.name} is asked for"
                + (": it waits for capacity." if made.queued else ": it is being made."),
            )
            return redirect("vm_create", lab.slug)
    context = {
        "lab": lab,
        "form": form,
        "offered": offered,
        "allowances": allowances.allowance_use(lab),
        "requests": VmRequest.objects.filter(lab=lab).select_related("vm", "requested_by")[:50],
        "generations": allowances.GENERATIONS,
        "kinds": Provisioning.choices,
    }
    return render(request, "tpus/vm_create.html", context, status=400 if form.errors else 200)


@login_required
@require_POST
def vm_request_cancel(request, slug, request_id):
    lab = access.get_admin_lab(request.user, slug)
    made = get_object_or_404(VmRequest, lab=lab, pk=request_id)
    try:
        made = vm_requests.cancel_request(request.user, made, request=request)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    else:
        if made.state == "cancelled":
            messages.success(request, f"The request for {made.name} is cancelled.")
    return redirect("vm_create", lab.slug)


@login_required
@require_POST
def vm_request_retry(request, slug, request_id):
    lab = access.get_admin_lab(request.user, slug)
    made = get_object_or_404(VmRequest, lab=lab, pk=request_id)
    try:
        again = vm_requests.retry_request(request.user, made, request=request)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(
            request,
            f"{again.name} is asked for again"
            + (": it waits for capacity." if again.queued else ": it is being made."),
        )
    return redirect("vm_create", lab.slug)


@login_required
@require_POST
def allowance_set(request, slug):
    """Site admins: one line of the lab's allowance (0 chips removes it)."""
    lab = access.get_lab_for_site_admin(request.user, slug, allowances.ALLOWANCE_SITE_ADMIN_ONLY)
    try:
        chips = int(request.POST.get("chips", ""))
    except ValueError:
        chips = -1
    try:
        allowances.set_allowance(
            request.user,
            lab,
            request.POST.get("generation", ""),
            request.POST.get("provisioning", ""),
            chips,
            request=request,
        )
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, "The lab's allowance is saved.")
    return redirect("vm_create", lab.slug)


@login_required
@require_POST
def vm_power(request, slug, vm_id, action):
    """Stop or start a VM (the call runs in the background)."""
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    change = {"stop": vm_lifecycle.stop_vm, "start": vm_lifecycle.start_vm}.get(action)
    if change is None:
        raise Http404("No such change.")
    try:
        change(request.user, vm, request=request)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    else:
        messages.success(request, f"{vm.name} is {'stopping' if action == 'stop' else 'starting'}.")
    return redirect("vm_detail", lab.slug, vm.pk)


@login_required
def vm_delete(request, slug, vm_id):
    """What deleting a VM takes with it, and the typed name that confirms it."""
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    error = ""
    if request.method == "POST":
        try:
            vm_lifecycle.delete_vm(request.user, vm, request.POST.get("name", ""), request=request)
        except ValidationError as exc:
            error = exc.messages[0]
        else:
            messages.success(request, f"{vm.name} is being deleted; everyone with access was told.")
            return redirect("vm_list", lab.slug)
    context = {"lab": lab, "vm": vm, "losses": vm_lifecycle.losses(vm), "error": error}
    return render(request, "tpus/vm_delete.html", context, status=400 if error else 200)

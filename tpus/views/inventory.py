"""Pages about a lab's TPU VMs and data disks (lab admins)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count, Prefetch, Q
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tpus import access
from tpus.cloud import CloudError
from tpus.forms_grants import GrantForm
from tpus.forms_inventory import AttachForm, DiskForm, ImportForm, ManualVmForm
from tpus.models import DiskAttachment, IpChange
from tpus.models.grants import WANTED_STATES
from tpus.services import disk_operations, inventory, sshconfig
from tpus.services.inventory import InventoryError
from tpus.views.grants import vm_progress_context


@login_required
def vm_list(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    vms = lab.vms.annotate(
        worker_count=Count("workers", distinct=True),
        people=Count("grants", filter=Q(grants__state__in=WANTED_STATES), distinct=True),
    ).order_by("name")
    disks = lab.disks.prefetch_related(
        Prefetch("attachments", queryset=DiskAttachment.objects.select_related("vm"))
    )
    return render(request, "tpus/vm_list.html", {"lab": lab, "vms": vms, "disks": disks})


@login_required
def vm_import(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    preview = inventory.preview_import(lab)
    form = ImportForm(request.POST or None, candidates=preview.candidates)
    if request.method == "POST" and form.is_valid():
        try:
            vms = inventory.import_vms(
                request.user, lab, form.cleaned_data["nodes"], request=request
            )
        except (InventoryError, CloudError) as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Imported {', '.join(vm.name for vm in vms)}.")
            return redirect("vm_list", lab.slug)
    return render(request, "tpus/vm_import.html", {"lab": lab, "preview": preview, "form": form})


@login_required
def vm_register(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    form = ManualVmForm(request.POST or None, lab=lab)
    if request.method == "POST" and form.is_valid():
        try:
            vm = inventory.register_manual_vm(
                request.user, lab, request=request, **form.cleaned_data
            )
        except InventoryError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"{vm.name} is registered. Confirm its host keys next.")
            return redirect("vm_detail", lab.slug, vm.pk)
    return render(request, "tpus/vm_register.html", {"lab": lab, "form": form})


@login_required
def vm_detail(request, slug, vm_id):
    """Lab admins see everything and manage access; a collaborator with access sees
    the workers, their own grant, and how to connect."""
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    is_admin = access.is_lab_admin(request.user, lab)
    context = {
        "lab": lab,
        "vm": vm,
        "is_admin": is_admin,
        "attachments": vm.attachments.select_related("disk"),
        "ip_changes": IpChange.objects.filter(worker__vm=vm).select_related("worker")[:20],
    }
    if is_admin:
        context.update(grant_form=GrantForm(lab=lab), **vm_progress_context(vm))
    else:
        context.update(
            workers=vm.workers.order_by("index"),
            my_grant=vm.grants.filter(user=request.user).first(),
            snippet=sshconfig.snippet_for(request.user, [vm]),
        )
    return render(request, "tpus/vm_detail.html", context)


@login_required
@require_POST
def vm_sync(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    from tpus.tasks import sync_lab_inventory

    sync_lab_inventory.delay_on_commit(lab.pk)
    messages.success(request, "Refreshing from the Cloud TPU API; reload in a moment.")
    return redirect("vm_list", lab.slug)


@login_required
def disk_register(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    form = DiskForm(request.POST or None, lab=lab)
    if request.method == "POST" and form.is_valid():
        try:
            disk = inventory.register_disk(request.user, lab, request=request, **form.cleaned_data)
        except InventoryError as exc:
            form.add_error(None, str(exc))
        else:
            return redirect("disk_detail", lab.slug, disk.pk)
    return render(request, "tpus/disk_register.html", {"lab": lab, "form": form})


@login_required
def disk_detail(request, slug, disk_id):
    lab = access.get_admin_lab(request.user, slug)
    disk = access.get_disk_for_admin(request.user, lab, disk_id)
    form = AttachForm(request.POST or None, disk=disk)
    if request.method == "POST" and form.is_valid():
        vm = form.cleaned_data["vm"]
        try:
            disk_operations.request_operation(
                request.user, disk, vm, "attach", mode=form.cleaned_data["mode"], request=request
            )
        except InventoryError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Attaching {disk.name} to {vm.name}…")
            return redirect("disk_detail", lab.slug, disk.pk)
    return render(
        request,
        "tpus/disk_detail.html",
        {"lab": lab, "disk": disk, "form": form, **_disk_state(disk)},
    )


def _disk_state(disk) -> dict:
    operations = list(disk.operations.select_related("vm")[:10])
    return {
        "attachments": disk.attachments.select_related("vm"),
        "operations": operations,
        "in_flight": any(op.in_flight for op in operations),
    }


@login_required
def disk_progress(request, slug, disk_id):
    lab = access.get_admin_lab(request.user, slug)
    disk = access.get_disk_for_admin(request.user, lab, disk_id)
    return render(request, "tpus/_disk_state.html", {"lab": lab, "disk": disk, **_disk_state(disk)})


@login_required
@require_POST
def disk_detach(request, slug, disk_id, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    disk = access.get_disk_for_admin(request.user, lab, disk_id)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    try:
        disk_operations.request_operation(request.user, disk, vm, "detach", request=request)
    except InventoryError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Detaching {disk.name} from {vm.name}…")
    return redirect("disk_detail", lab.slug, disk.pk)

"""Pages about a lab's TPU VMs and data disks (lab admins)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import (
    Count,
    IntegerField,
    OuterRef,
    Prefetch,
    Subquery,
    prefetch_related_objects,
)
from django.db.models.functions import Coalesce
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from portal.paging import page_of
from tpus import access, queue
from tpus.cloud import CloudError
from tpus.forms.inventory import AttachForm, DiskForm, ImportForm, ManualVmForm, VmFilterForm
from tpus.models import DiskAttachment, Grant, IpChange, Worker
from tpus.models.grants import WANTED_STATES
from tpus.models.inventory import worker_alias
from tpus.services import (
    directory,
    disk_mounts,
    disk_operations,
    elastic_pools,
    inventory,
    keep_alive,
    sshconfig,
    sync_health,
)
from tpus.services import jobs as job_services
from tpus.services.hosts import STOPPED, stopped_workers
from tpus.services.inventory import InventoryError
from tpus.views.connect import connection_context
from tpus.views.grants import grant_summary
from tpus.views.jobs import vm_jobs_context


def _count(rows) -> Subquery:
    """``COUNT(*)`` of ``rows`` (correlated to the outer row) as a subquery."""
    counted = rows.order_by().values("vm").annotate(n=Count("pk")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


# What the VM list shows of each VM, read as plain rows with the counts it adds:
# model instances for a page of VMs cost it about 0.4 ms a request, and the
# template reads a dict faster.
VM_ROW_FIELDS = (
    "pk",
    "name",
    "zone",
    "accelerator_type",
    "state",
    "health",
    "source",
    "last_seen_at",
    "missing_since",
    "worker_count",
    "people",
    "stopped",
)


@login_required
def vm_list(request, slug):
    """One page of the lab's TPU VMs, found by name, zone, state and type."""
    lab = access.get_admin_lab(request.user, slug)
    # The zone and type choices, with how many VMs there are of each, in one query.
    # order_by(): without it the model's ordering by name joins the GROUP BY, and
    # every VM's row comes back instead of each (zone, type) pair once.
    kinds = list(lab.vms.order_by().values_list("zone", "accelerator_type").annotate(n=Count("*")))
    filters = VmFilterForm(
        request.GET or None,
        zones=sorted({*lab.zones, *(zone for zone, _, _ in kinds)}),
        accelerators=sorted({kind for _, kind, _ in kinds if kind}),
    )
    chosen = filters.filters()
    # Counted per row by subqueries on the page's 50 VMs, not by joining every VM's
    # workers and grants and grouping before the page is cut.
    vms = (
        directory.vms(lab, **chosen)
        .annotate(
            worker_count=_count(Worker.objects.filter(vm=OuterRef("pk"))),
            stopped=_count(Worker.objects.filter(STOPPED, vm=OuterRef("pk"))),
            people=_count(Grant.objects.filter(vm=OuterRef("pk"), state__in=WANTED_STATES)),
        )
        .values(*VM_ROW_FIELDS)
    )
    disks = lab.disks.prefetch_related(
        Prefetch(
            "attachments",
            queryset=DiskAttachment.objects.select_related("vm").order_by("vm__name"),
        )
    )
    # Unfiltered, the list is every VM of the lab: counted above already.
    total = sum(n for _, _, n in kinds)
    return render(
        request,
        "tpus/vm_list.html",
        {
            "lab": lab,
            "filters": filters,
            "page": page_of(request, vms, count=None if chosen else lambda: total),
            "disks": disks,
            "site_admin": request.user.is_site_admin,
            "zone_syncs": sync_health.for_lab(lab),
        },
    )


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
            for refusal in (r for vm in vms for r in vm.host_key_refusals):
                messages.error(request, refusal)
            return redirect("vm_list", lab.slug)
    return render(request, "tpus/vm_import.html", {"lab": lab, "preview": preview, "form": form})


@login_required
def vm_register(request, slug):
    """Site admins only: a hand-typed address is not proven to be the lab's VM, so it
    takes someone who runs the portal for every lab to vouch for it."""
    lab = access.get_lab_for_site_admin(request.user, slug, inventory.MANUAL_SITE_ADMIN_ONLY)
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
    """A TPU VM's overview. Lab admins see its workers and pinned host keys, the portal's
    connection, how many people have access (managed on the VM's access page), jobs,
    disks and addresses; a collaborator with access sees the workers, their own grant,
    and how to connect."""
    lab = access.get_member_lab(request.user, slug)
    is_admin = access.is_lab_admin(request.user, lab)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id, is_admin=is_admin)
    context = {"lab": lab, "vm": vm, "is_admin": is_admin}
    if is_admin:
        summary = grant_summary(vm, request.user)  # an admin may have access too
        may_run = job_services.state_runs_jobs(summary["mine"])
        # Plain rows: a pod's table has a row a worker.
        workers = list(vm.workers.order_by("index").values(*WORKER_ROW))
        for worker in workers:
            worker["alias"] = worker_alias(vm.name, worker["index"])
        aliases = {w["id"]: w["alias"] for w in workers}
        context.update(
            workers=workers,
            access_summary=summary,
            **connection_context(vm),
        )
    else:
        my_grant = vm.grants.filter(user=request.user).first()
        may_run = job_services.state_runs_jobs(my_grant and my_grant.state)
        context["stopped"] = stopped_workers(vm)
        prefetch_related_objects([vm], "workers")  # one query for the table and the snippet
        workers = sorted(vm.workers.all(), key=lambda w: w.index)
        aliases = {w.pk: w.alias for w in workers}
        context.update(
            my_grant=my_grant,
            workers=workers,
            snippet=sshconfig.snippet_for(request.user, [vm]),
        )
    context.update(
        disk_rows=disk_mounts.disk_rows(vm),
        **vm_jobs_context(request.user, lab, vm, is_admin=is_admin, may_run=may_run),
    )
    context["ip_changes"] = address_history(vm, aliases)
    context["kept_down"] = keep_alive.held_down(vm)
    pool = elastic_pools.made_by(vm)
    context["made_by_pool"] = elastic_pools.made_text(pool) if pool else ""
    return render(request, "tpus/vm_detail.html", context)


ADDRESS_CHANGES_SHOWN = 20
# What a row of an admin's "Workers" table shows.
WORKER_ROW = (
    "id", "index", "external_ip", "internal_ip", "host_keys", "host_keys_source",
    "host_keys_pinned_at", "host_key_mismatch_at", "presented_host_key",
    "host_key_alarm_published",
)  # fmt: skip


def address_history(vm, aliases: dict[int, str]) -> list[IpChange]:
    """The VM's latest address changes, each row given its worker's ``alias`` from
    ``aliases`` (worker id → alias: the page has its workers already) rather than
    joined in again."""
    changes = list(IpChange.objects.filter(worker__vm=vm)[:ADDRESS_CHANGES_SHOWN])
    for change in changes:
        change.alias = aliases.get(change.worker_id) or change.worker.alias
    return changes


@login_required
@require_POST
def vm_sync(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    queue.refresh_lab(lab.pk)
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

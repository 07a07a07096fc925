"""Confirming a worker's host keys: for VMs registered by hand, workers whose guest
attributes had none, and workers that presented a different key."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render

from tpus import access
from tpus.services import hostkey_alarms, hostkey_scans, inventory


def _scan_context(lab, worker) -> dict:
    """What the scan part of the page shows: the worker's scan of its current
    address, and for finished ones the signed confirmation of exactly those keys."""
    scan = hostkey_scans.current_scan(worker)
    scanned = hostkey_scans.scanned_keys(scan)
    return {
        "lab": lab,
        "worker": worker,
        "vm": worker.vm,
        "scan": scan,
        "scanned": scanned,
        "shown": hostkey_scans.shown_token(worker, scan.address, scanned) if scanned else "",
        "same_as_pinned": bool(scanned) and sorted(scanned) == sorted(worker.host_keys),
    }


@login_required
def worker_keys(request, slug, vm_id, index):
    """GET: the pinned and published keys, and the last scan of what the worker offers
    now. POST ``action=scan``: read the keys again, as queued work (the page polls
    ``worker_keys_scan``). POST ``shown``: pin exactly the keys that were shown, for
    the worker and address they were read from (signed into the form, so what is
    pinned is what the admin saw)."""
    lab = access.get_admin_lab(request.user, slug)
    worker = access.get_worker_for_admin(request.user, lab, vm_id, index)
    action = request.POST.get("action") if request.method == "POST" else None
    if action == "resume":
        if hostkey_alarms.resume_after_alarm(request.user, worker, request=request):
            messages.success(
                request,
                f"Provisioning of {worker.alias} resumes; if it still presents another key, "
                "the alarm comes back.",
            )
        return redirect("vm_detail", lab.slug, vm_id)
    if action == "scan":
        try:
            hostkey_scans.start_scan(request.user, worker)
        except inventory.InventoryError as exc:
            messages.error(request, str(exc))
        return redirect("worker_keys", lab.slug, vm_id, index)
    if request.method == "POST":
        try:
            hostkey_scans.pin_shown_keys(
                request.user, worker, request.POST.get("shown", ""), request=request
            )
        except inventory.InventoryError as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Host keys of {worker.alias} are pinned.")
            return redirect("vm_detail", lab.slug, vm_id)
        return redirect("worker_keys", lab.slug, vm_id, index)
    return render(request, "tpus/worker_keys.html", _scan_context(lab, worker))


@login_required
def worker_keys_scan(request, slug, vm_id, index):
    """The scan part of the keys page alone, polled by htmx while the scan runs."""
    lab = access.get_admin_lab(request.user, slug)
    worker = access.get_worker_for_admin(request.user, lab, vm_id, index)
    return render(request, "tpus/_worker_keys_scan.html", _scan_context(lab, worker))

"""Confirming a worker's host keys: for VMs registered by hand, workers whose guest
attributes had none, and workers that presented a different key."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core import signing
from django.shortcuts import redirect, render

from tpus import access
from tpus.remote import RemoteError, scan_host_keys
from tpus.remote.pins import HostKeyPins, InvalidHostKey
from tpus.services import inventory

SALT = "tpu-portal.host-keys-shown"


@login_required
def worker_keys(request, slug, vm_id, index):
    """GET: read the keys the worker offers now and show their fingerprints. POST:
    pin exactly the keys that were shown (signed into the form, so what is pinned is
    what the admin saw)."""
    lab = access.get_admin_lab(request.user, slug)
    worker = access.get_worker_for_admin(request.user, lab, vm_id, index)
    if request.method == "POST":
        try:
            lines = signing.loads(request.POST.get("shown", ""), salt=SALT, max_age=900)
            HostKeyPins.parse(lines)
            if worker.is_pinned:
                inventory.repin_host_keys(request.user, worker, lines, request=request)
            else:
                inventory.pin_host_keys(request.user, worker, lines, request=request)
        except (signing.BadSignature, InvalidHostKey, TypeError):
            messages.error(request, "Those keys were not the ones shown; scan again.")
        except inventory.InventoryError as exc:
            messages.error(request, str(exc))
        else:
            messages.success(request, f"Host keys of {worker.alias} are pinned.")
            return redirect("vm_detail", lab.slug, vm_id)
        return redirect("worker_keys", lab.slug, vm_id, index)
    scanned, error = [], ""
    if worker.external_ip:
        try:
            scanned = scan_host_keys(worker.external_ip)
        except RemoteError as exc:
            error = str(exc)
    else:
        error = "The worker has no external IP right now."
    return render(
        request,
        "tpus/worker_keys.html",
        {
            "lab": lab,
            "worker": worker,
            "vm": worker.vm,
            "scanned": scanned,
            "error": error,
            "shown": signing.dumps(scanned, salt=SALT) if scanned else "",
            "same_as_pinned": sorted(scanned) == sorted(worker.host_keys),
        },
    )

"""Connect a TPU VM to its lab (the lab's key in the node's ssh-keys metadata), and
the live state of that connection, for lab admins."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tpus import access
from tpus.services import connect
from tpus.services.hosts import stopped_workers


def connection_context(vm) -> dict:
    """The connection state, the workers whose provisioning is stopped (a connection
    line that says "Connected" must not hide them) and the manual route, for the VM
    page and its live part."""
    return {
        "connection": connect.connection_of(vm),
        "stopped": stopped_workers(vm),
        "manual": connect.manual_route(vm),
    }


@login_required
def vm_connection(request, slug, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    context = {"lab": lab, "vm": vm, **connection_context(vm)}
    return render(request, "tpus/_vm_connection.html", context)


@login_required
@require_POST
def vm_connect(request, slug, vm_id):
    done = "Connecting: the lab's key is in the VM's metadata; waiting for the workers."
    return _change(request, slug, vm_id, connect.connect_vm, done)


@login_required
@require_POST
def vm_disconnect(request, slug, vm_id):
    done = "Disconnected: the lab's key line was removed from the VM's metadata."
    return _change(request, slug, vm_id, connect.disconnect_vm, done)


def _change(request, slug, vm_id, action, done: str):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    try:
        action(request.user, vm, request=request)
    except connect.ConnectError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, done)
    return redirect("vm_detail", lab.slug, vm.pk)

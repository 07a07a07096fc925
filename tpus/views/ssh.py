"""A collaborator's ssh config and known_hosts: the page, the downloads, and the
private refresh URL for cron (which authenticates by its token alone)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from portal.htmx import is_htmx
from tpus import access
from tpus.models import ConfigFeed, Grant
from tpus.models.grants import WANTED_STATES
from tpus.services import forwards, sshconfig


def _text(body: str, filename: str) -> HttpResponse:
    response = HttpResponse(body, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["Cache-Control"] = "no-store"
    return response


def _sudo_warnings(user, vms) -> list[tuple[str, list[str]]]:
    """In the order of ``vms``: each VM where others have sudo, and who (agent
    forwarding would expose the person's agent to them)."""
    rows = (
        Grant.objects.filter(vm__in=vms, sudo=True, state__in=WANTED_STATES)
        .exclude(user=user)
        .values_list("vm_id", "user__unix_account__username")
    )
    found: dict[int, list[str]] = {}
    for vm_id, name in rows:
        found.setdefault(vm_id, []).append(name)
    return [(vm.name, found[vm.pk]) for vm in vms if vm.pk in found]


def _vm_rows(user, vms, among=None, kept=None) -> list[dict]:
    """Per VM: the name the person types for it and the forwards kept in its block
    (``kept``, from ``forwards_for``; looked up when not given)."""
    names = sshconfig.names_for(sshconfig.merged(vms, among))
    if kept is None:
        kept = sshconfig.forwards_for(user, vms)
    return [{"vm": vm, "host": names[vm.pk].host, "forwards": kept.get(vm.pk, [])} for vm in vms]


@login_required
def ssh_page(request):
    user = request.user
    if not hasattr(user, "unix_account"):
        return render(request, "tpus/ssh.html", {"no_account": True})
    vms = sshconfig.vms_for(user)
    feed = sshconfig.feed_of(user)
    kept = sshconfig.forwards_for(user, vms)
    forwarding = any(sshconfig.forward_agent(user, vm) for vm in vms)
    return render(
        request,
        "tpus/ssh.html",
        {
            "vms": vms,
            "rows": _vm_rows(user, vms, kept=kept),
            "snippet": sshconfig.snippet_for(user, vms, among=vms, forwards=kept),
            "feed": feed,
            "refresh_command": sshconfig.refresh_command(feed),
            # Who could use the person's agent matters only while it is forwarded.
            "sudo_warnings": _sudo_warnings(user, vms) if forwarding else [],
            "config_path": sshconfig.CONFIG_PATH,
            "known_hosts_path": sshconfig.KNOWN_HOSTS_PATH,
        },
    )


@login_required
@require_POST
def ssh_feed_rotate(request):
    had_one = sshconfig.feed_urls(request.user) is not None
    sshconfig.rotate_feed(request.user)
    if had_one:
        messages.success(request, "Your refresh URL is new; the old one no longer works.")
    else:
        messages.success(request, "Your refresh URL is ready: run the command below.")
    return redirect("ssh_page")


@login_required
@require_POST
def ssh_feed_disable(request):
    sshconfig.disable_feed(request.user)
    messages.success(request, "Your refresh URL no longer works.")
    return redirect("ssh_page")


@login_required
@require_POST
def ssh_forwarding(request):
    choice = {"yes": True, "no": False}.get(request.POST.get("forward_agent", ""))
    if choice is None:
        messages.error(request, "Choose whether to forward your agent: yes or no.")
        return redirect("ssh_page")
    feed = sshconfig.feed_for(request.user)
    ConfigFeed.objects.filter(pk=feed.pk).update(forward_agent=choice)
    return redirect("ssh_page")


def _forwards_box(request, vm, *, line="", note="", error="", values=None):
    """After a forward request: the VM's box for htmx; else a message and the page."""
    if is_htmx(request):
        context = {
            "row": _vm_rows(request.user, [vm], among=sshconfig.naming_peers(request.user))[0],
            "line": line,
            "note": note,
            "error": error,
            "values": values or {},
        }
        return render(request, "tpus/_ssh_forwards.html", context)
    if error:
        messages.error(request, error)
    for text in (note, line):
        if text:
            messages.info(request, text)
    return redirect(reverse("ssh_page") + f"#forwards-{vm.pk}")


@login_required
@require_POST
def ssh_forward(request, vm_id):
    """The ``ssh -N -L`` line for the chosen ports, or (``action=add``) the forward
    kept in the VM's Host block of the config. Bad ports: the reason, nothing kept."""
    vm = access.get_vm_for_grantee(request.user, vm_id)
    local, remote = request.POST.get("local_port", ""), request.POST.get("remote_port", "")
    values = {"local_port": local, "remote_port": remote}
    try:
        if request.POST.get("action") == "add":
            kept = forwards.add_forward(request.user, vm, local, remote)
            host = sshconfig.host_name_for(request.user, vm)
            note = (
                f"{host} now forwards localhost:{kept.local_port} to its port"
                f" {kept.remote_port} whenever you are logged in. Download your config again"
                " (or let your refresh command do it); then this keeps just the forwards open:"
            )
            return _forwards_box(request, vm, note=note, line=f"ssh -N {host}", values=values)
        line = forwards.tunnel_command(request.user, vm, local, remote)
    except forwards.ForwardError as exc:
        return _forwards_box(request, vm, error=str(exc), values=values)
    return _forwards_box(request, vm, line=line, values=values)


@login_required
@require_POST
def ssh_forward_remove(request, vm_id, local_port):
    vm = access.get_vm_for_grantee(request.user, vm_id)
    forwards.remove_forward(request.user, vm, local_port)
    return _forwards_box(request, vm)


@login_required
@require_GET
def ssh_config_download(request):
    return _text(sshconfig.render_config(request.user), "tpu-portal")


@login_required
@require_GET
def ssh_known_hosts_download(request):
    return _text(
        sshconfig.render_known_hosts(sshconfig.vms_for(request.user)), "tpu-portal_known_hosts"
    )


def _feed_user(token):
    user = sshconfig.user_for_token(token)
    if user is None:
        raise Http404("No such feed.")
    ConfigFeed.objects.filter(user=user).update(last_fetched_at=timezone.now())
    return user


@require_GET
def ssh_feed_config(request, token):
    return _text(sshconfig.render_config(_feed_user(token)), "tpu-portal")


@require_GET
def ssh_feed_known_hosts(request, token):
    user = _feed_user(token)
    return _text(sshconfig.render_known_hosts(sshconfig.vms_for(user)), "tpu-portal_known_hosts")

"""Pages for giving and taking access to TPU VMs, with live per-worker progress."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Case, Count, F, Max, Q, Value, When
from django.shortcuts import redirect, render
from django.template.defaultfilters import pluralize
from django.utils import timezone
from django.utils.functional import SimpleLazyObject
from django.views.decorators.http import require_POST

from portal.paging import page_of
from tpus import access
from tpus.forms.grants import GrantForm, MemberGrantForm
from tpus.forms.labs import ShareForm
from tpus.models.grants import GrantState
from tpus.services import directory, disk_mounts, fair_share, leases
from tpus.services import grants as grant_services
from tpus.services.grants import GrantError

# A grant's row on the access page, as plain values (rows of dicts render faster than
# models): the grant, and its person's unix username and email.
GRANT_ROW = ("pk", "sudo", "expires_on", "state", "error", "changed_at")
GRANT_PERSON = {"username": F("user__unix_account__username"), "email": F("user__email")}


# The live part shows the grants still on their way, and apart from them those that
# finished this recently (so the admin sees the outcome of what they just did land,
# not an hour of old news), at most PROGRESS_GRANTS in all.
FINISHED_SHOWN = dt.timedelta(minutes=5)
PROGRESS_GRANTS = 20


def vm_progress_context(vm) -> dict:
    """What changes while a VM is being provisioned: the grants in flight
    (``changes``), those that finished in the last few minutes (``finished``), and each
    worker's last reconcile. Every grant is on the VM's access page, paged."""
    moving = Q(state__in=(GrantState.PENDING, GrantState.REVOKING))
    rank = Case(When(moving, then=Value(0)), default=Value(1))  # 0: in flight
    shown = (
        vm.grants.filter(moving | Q(changed_at__gte=timezone.now() - FINISHED_SHOWN))
        .annotate(rank=rank)
        .order_by("rank", "-changed_at", "-pk")
        .values("pk")[:PROGRESS_GRANTS]
    )
    # The rows chosen first, then their people joined: joined before the limit, the
    # people of every grant on the VM would be read.
    grants = list(
        vm.grants.filter(pk__in=shown)
        .annotate(rank=rank)
        .order_by("rank", "-changed_at", "-pk")
        .values(*GRANT_ROW, "rank", **GRANT_PERSON)
    )
    workers = list(vm.workers.select_related("sync").order_by("index").only(*SYNC_ROW))
    # Grants in flight come first: if there is one, the list starts with it.
    in_flight = bool(grants) and grants[0]["rank"] == 0
    # Whether a reconcile is running now, or one died and stopped renewing its claim.
    running, stalled_since = leases.held_or_stalled(vm.reconcile_claimed_until)
    return {
        "vm": vm,
        "changes": [g for g in grants if g["rank"] == 0],
        "finished": [g for g in grants if g["rank"] != 0],
        "finished_minutes": int(FINISHED_SHOWN.total_seconds() // 60),
        "progress_grants": grants,
        "workers": workers,
        "sync_rows": sync_rows(vm, workers, running=running, stalled_since=stalled_since),
        # Disks no worker mounts (two at one mount point): the rest still goes through.
        "disk_problems": disk_mounts.problems(vm, shared=len(workers) > 1),
        "in_flight": in_flight,
        "running": running,
        "stalled_since": stalled_since,
    }


# What a line of "Provisioning on each worker" reads of a worker and its last reconcile.
SYNC_ROW = (
    "vm_id", "index", "host_keys", "host_key_mismatch_at", "sync__applied_version",
    "sync__last_error", "sync__last_error_retryable", "sync__last_success_at", "sync__last_report",
    "sync__disk_waits",
)  # fmt: skip


@dataclass
class SyncRow:
    """A line of "Provisioning on each worker": one worker, or neighbouring workers
    that are all in the same state with the same answer (a pod in step is one line)."""

    workers: list
    badge: str
    state: str
    title: str = ""
    answer: str = ""
    error: str = ""
    drift: tuple = ()
    waiting: tuple = ()
    disk_errors: tuple = ()
    mismatch_at: dt.datetime | None = None
    successes: list = field(default_factory=list)

    @property
    def first(self):
        return self.workers[0]

    @property
    def label(self) -> str:
        if len(self.workers) == 1:
            return self.first.alias
        return f"{self.first.alias} – {self.workers[-1].alias} ({len(self.workers)} workers)"

    @property
    def last_success_at(self) -> dt.datetime | None:
        """The oldest of the line's last successes; None if one never succeeded."""
        return None if None in self.successes else min(self.successes, default=None)

    def key(self) -> tuple:
        return (self.badge, self.state, self.title, self.answer, self.error, self.drift,
                self.waiting, self.disk_errors, self.mismatch_at,
                None in self.successes)  # fmt: skip


def sync_rows(vm, workers, *, running: bool, stalled_since) -> list[SyncRow]:
    """Each worker's provisioning state, neighbours in the same state on one line."""
    rows: list[SyncRow] = []
    for worker in workers:
        row = _sync_row(vm, worker, running=running, stalled_since=stalled_since)
        if rows and rows[-1].key() == row.key():
            rows[-1].workers.append(worker)
            rows[-1].successes.extend(row.successes)
        else:
            rows.append(row)
    return rows


def _sync_row(vm, worker, *, running: bool, stalled_since) -> SyncRow:
    sync = worker.last_sync
    if sync is not None and sync.applied_version >= vm.desired_version:
        badge, state, title = "ok", "up to date", ""
    elif sync is not None and sync.last_error:
        badge, state, title = "failed", "retrying" if sync.last_error_retryable else "failed", ""
    elif not worker.is_pinned:
        badge, state, title = "failed", "host keys not confirmed", ""
    elif stalled_since:
        badge, state = "failed", f"stalled since {timezone.localtime(stalled_since):%H:%M:%S}"
        title = "The run that held this VM stopped; it is picked up again shortly."
    else:
        badge, state, title = "pending", "working…" if running else "queued", ""
    row = SyncRow([worker], badge, state, title, mismatch_at=worker.host_key_mismatch_at)
    if sync is None:
        row.successes = [None]
        return row
    row.successes = [sync.last_success_at]
    report = sync.last_report or {}
    if sync.last_error:
        row.error = sync.last_error
    elif report.get("values"):
        changed = str(report["values"].get("changed") or "0")
        row.answer = "in step" if changed == "0" else f"{changed} change{pluralize(changed)} made"
        row.drift = tuple(report.get("drift_user") or ())
        # A device waited for past its bound is an error, no longer "waiting".
        late = disk_mounts.late_devices(sync.disk_waits)
        waiting = tuple(report.get("waiting_device") or ())
        row.waiting = tuple(d for d in waiting if d not in late)
        row.disk_errors = (
            tuple(f"disks: {e}" for e in report.get("disk_error") or ())
            + tuple(
                f"disk {device}: {reason}"
                for device, _, reason in (e.partition(":") for e in report.get("mount_error") or ())
            )
            + tuple(f"disk {d}: {disk_mounts.late_message(d)}" for d in waiting if d in late)
        )
    return row


# "Who has access" rows each carry their own buttons; a shorter page keeps the page
# quick on a pod with hundreds of people.
ACCESS_PAGE_SIZE = 25


def grant_summary(vm, viewer) -> dict:
    """How many people have access to ``vm``, how many changes are on their way and how
    many failed (the VM overview's pointer to its access page), and the state of the
    viewer's own grant there (``mine``, None without one), in one query."""
    return vm.grants.aggregate(
        active=Count("pk", filter=Q(state=GrantState.ACTIVE)),
        moving=Count("pk", filter=Q(state__in=(GrantState.PENDING, GrantState.REVOKING))),
        failed=Count("pk", filter=Q(state=GrantState.FAILED)),
        mine=Max("state", filter=Q(user=viewer)),  # one grant a person and VM
    )


@login_required
def vm_access(request, slug, vm_id):
    """A TPU VM's access, for the lab's admins: give it (once every worker's host keys
    are confirmed), follow each change onto every worker live, and see, retry or revoke
    everyone's access a page at a time."""
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    grants = vm.grants.order_by("user__unix_account__username", "user__email", "pk")
    grants_page = page_of(
        request,
        grants.values(*GRANT_ROW, **GRANT_PERSON, kind=F("from_kind__accelerator_type")),
        param="grants",
        size=ACCESS_PAGE_SIZE,
        count=vm.grants.count,  # without the joins the rows need
    )
    progress = vm_progress_context(vm)
    context = {
        "lab": lab,
        "grant_form": GrantForm(lab=lab),
        # Counted only if the form is shown (every worker's host keys confirmed).
        "readiness": SimpleLazyObject(lambda: directory.vm_readiness(lab, vm)),
        "grants_page": grants_page,
        # "Give access" waits until every worker's host keys are confirmed.
        "unpinned_workers": [w for w in progress["workers"] if not w.is_pinned],
        **progress,
    }
    return render(request, "tpus/vm_access.html", context)


@login_required
def vm_progress(request, slug, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    return render(
        request, "tpus/_vm_progress.html", {"lab": lab, "partial": True, **vm_progress_context(vm)}
    )


@login_required
@require_POST
def grant_create(request, slug, vm_id):
    lab = access.get_admin_lab(request.user, slug)
    vm = access.get_vm_for_admin(request.user, lab, vm_id)
    form = GrantForm(request.POST, lab=lab)
    if not form.is_valid():
        messages.error(request, " ".join(e for errors in form.errors.values() for e in errors))
        return redirect("vm_access", lab.slug, vm.pk)
    user = form.cleaned_data["user"]
    try:
        [grant] = grant_services.grant_access(
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
        # Tagged with the grant, so the live progress can replace it once it settles.
        messages.success(
            request,
            f"Adding {user.unix_account.username} to {vm.name}…",
            extra_tags=f"grant-{grant.pk}",
        )
    return redirect("vm_access", lab.slug, vm.pk)


@login_required
def member_grant(request, slug, membership_id):
    """A member's own page for the lab's admins: their standing, their role, their
    access (a page at a time), and giving them one more TPU VM."""
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = MemberGrantForm(request.POST or None, lab=lab)
    if request.method == "POST" and form.is_valid():
        vm = form.cleaned_data["vm"]
        try:
            grant_services.grant_access(
                request.user,
                lab,
                membership.user,
                [vm],
                sudo=form.cleaned_data["sudo"],
                expires_on=form.cleaned_data["expires_on"],
                request=request,
            )
        except GrantError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Giving {membership.user.email} access to {vm.name}…")
            return redirect("member_grant", lab.slug, membership.pk)
    grants = (
        membership.user.grants.filter(vm__lab=lab)
        .select_related("vm", "from_kind")
        .order_by("vm__name")
    )
    standing = fair_share.standings(lab, [membership.user_id])[membership.user_id]
    context = {
        "lab": lab,
        "membership": membership,
        "form": form,
        "page": page_of(request, grants),
        "standing": standing,
        "share_form": ShareForm(initial={"share": f"{standing.share:g}"}),
    }
    return render(request, "tpus/member_grant.html", context)


@login_required
def vm_search(request, slug):
    """The member page's TPU VM picker: at most a screenful of the lab's VMs."""
    lab = access.get_admin_lab(request.user, slug)
    q = request.GET.get("vm", "")
    options = [
        directory.Candidate(value=vm.name, label=f"{vm.name} ({vm.zone})", problem="")
        for vm in directory.vm_candidates(lab, q)
    ]
    return render(
        request,
        "tpus/_picker_options.html",
        {"options": options, "q": q, "listbox_id": "grant-vm-options"},
    )


@login_required
@require_POST
def grant_revoke(request, slug, grant_id):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    grant_services.revoke_access(request.user, grant, request=request)
    messages.success(request, f"Revoking {grant.user.email}'s access to {grant.vm.name}…")
    return redirect("vm_access", lab.slug, grant.vm_id)


@login_required
@require_POST
def grant_retry(request, slug, grant_id):
    lab = access.get_admin_lab(request.user, slug)
    grant = access.get_grant_for_admin(request.user, lab, grant_id)
    grant_services.retry_grant(request.user, grant, request=request)
    return redirect("vm_access", lab.slug, grant.vm_id)

"""Pages about labs and memberships. Each view: one scoped lookup, a form, one
service call, then a redirect or a page."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, F, IntegerField, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from portal import heartbeat, outbox
from portal.htmx import is_htmx
from portal.paging import page_of
from tpus import access, audit
from tpus.forms.labs import (
    AcceptInviteForm,
    InviteForm,
    JoinForm,
    LabCreateForm,
    LabSettingsForm,
    MemberFilterForm,
    RejectForm,
    RoleForm,
    ShareForm,
    SiteLabSettingsForm,
)
from tpus.models import Worker
from tpus.models.grants import GrantState
from tpus.models.labs import Membership, MembershipState, Role
from tpus.services import allowances, directory, fair_share, sync_health
from tpus.services import labs as lab_services
from tpus.services.hosts import STOPPED
from tpus.services.labs import LabError


@login_required
def dashboard(request):
    user = request.user
    memberships = user.memberships.select_related("lab").order_by("lab__name")
    admin_labs = access.admin_labs(user).annotate(
        pending=Count("memberships", filter=Q(memberships__state=MembershipState.REQUESTED))
    )
    return render(
        request,
        "tpus/dashboard.html",
        {
            "memberships": memberships,
            "admin_labs": admin_labs,
            "tokens": user.api_tokens.live().count(),
            "my_grants": user.grants.exclude(state="revoked").select_related("vm__lab"),
            "ssh_keys": user.ssh_keys.all(),
            "background": heartbeat.status(settings.PORTAL_HEARTBEAT_SECONDS)
            if user.is_site_admin
            else None,
            "mail_backlog": outbox.backlog() if user.is_site_admin else None,
        },
    )


@login_required
def lab_list(request):
    labs = access.visible_labs(request.user)
    mine = {m.lab_id: m for m in request.user.memberships.all()}
    shown = access.project_visible_lab_ids(request.user)
    rows = [(lab, mine.get(lab.pk), lab.pk in shown) for lab in labs]
    return render(request, "tpus/lab_list.html", {"rows": rows})


@login_required
def lab_create(request):
    if not request.user.is_site_admin:
        raise PermissionDenied("Only site admins can create labs.")
    form = LabCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = dict(form.cleaned_data)
        emails = data.pop("admin_emails")
        try:
            lab = lab_services.create_lab(
                request.user, admin_emails=emails, request=request, **data
            )
        except LabError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"{lab.name} is open.")
            return redirect("lab_admin", lab.slug)
    return render(request, "tpus/lab_form.html", {"form": form, "creating": True})


@login_required
def lab_detail(request, slug):
    """What a member needs: their own VMs and access, whom to ask (the lab's admins),
    and the policy. Other members' names and addresses are for the admins' page."""
    lab = access.get_visible_lab(request.user, slug)
    membership = request.user.memberships.filter(lab=lab).first()
    is_member = access.member_labs(request.user).filter(pk=lab.pk).exists()
    context = {
        "lab": lab,
        "membership": membership,
        "is_member": is_member,
        "is_admin": is_member and access.is_lab_admin(request.user, lab),
        "join_form": JoinForm(),
    }
    if is_member:
        context["my_grants"] = (
            request.user.grants.filter(vm__lab=lab)
            .exclude(state=GrantState.REVOKED)
            .select_related("vm")
            # How many of the VM's workers the portal cannot provision now: access
            # that reads "Active" there may not let the person in.
            .annotate(
                stopped=Coalesce(
                    Subquery(
                        Worker.objects.filter(STOPPED, vm=OuterRef("vm_id"))
                        .order_by()
                        .values("vm")
                        .annotate(n=Count("pk"))
                        .values("n"),
                        output_field=IntegerField(),
                    ),
                    0,
                )
            )
            .order_by("vm__name")
        )
        context["my_standing"] = fair_share.standings(lab, [request.user.pk])[request.user.pk]
        context["admins"] = lab.memberships.filter(
            state=MembershipState.APPROVED, role=Role.ADMIN
        ).select_related("user")
    return render(request, "tpus/lab_detail.html", context)


@login_required
def lab_join(request, slug):
    lab = access.get_visible_lab(request.user, slug)
    form = JoinForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            lab_services.request_membership(
                request.user,
                lab,
                purpose=form.cleaned_data["purpose"],
                accept_policy=form.cleaned_data["accept_policy"],
                request=request,
            )
        except LabError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Your request to join {lab.name} was sent to its admins.")
            return redirect("lab_detail", lab.slug)
    membership = request.user.memberships.filter(lab=lab).first()
    return render(
        request, "tpus/lab_join.html", {"lab": lab, "form": form, "membership": membership}
    )


@login_required
@require_POST
def policy_accept(request, slug):
    lab = access.get_member_lab(request.user, slug)
    membership = request.user.memberships.filter(lab=lab).first()
    if membership is not None:
        lab_services.accept_policy(request.user, membership, request=request)
        messages.success(request, "Thank you: you accepted the current policy.")
    return redirect("lab_detail", lab.slug)


# The admin page shows this many of the oldest requests to join; deciding them
# brings up the next ones, and the member list filtered by state shows them all.
REQUESTS_SHOWN = 10
# Members per page of the admin page's list (each row links to the person's access).
MEMBERS_PAGE_SIZE = 25


def _member_rows(memberships):
    """What the member list shows of each membership, its person and their username,
    as plain rows: model instances for a page of members and their people cost the
    page about 0.4 ms a request, and the template reads a dict faster."""
    return memberships.values(
        "pk",
        "role",
        "state",
        "policy_version_accepted",
        "user_id",
        email=F("user__email"),
        full_name=F("user__full_name"),
        username=F("user__unix_account__username"),
        since=Coalesce("decided_at", "requested_at"),
    )


def _with_standings(lab, page):
    """The page's members with ``standing``: their share of the pool, recent use and
    running chips (``fair_share.standings``: two queries for the page)."""
    page.object_list = rows = list(page.object_list)
    found = fair_share.standings(lab, {row["user_id"] for row in rows})
    for row in rows:
        row["standing"] = found[row["user_id"]]
    return page


@login_required
def lab_admin(request, slug):
    """The lab's TPU allowance and what it holds against it, requests to join (the
    oldest first), then one page of members found by name, email or username and by
    state. An htmx search swaps just the member list."""
    lab = access.get_admin_lab(request.user, slug)
    filters = MemberFilterForm(request.GET or None)
    chosen = filters.filters()
    members = _member_rows(directory.memberships(lab, **chosen))
    if is_htmx(request):
        page = _with_standings(lab, page_of(request, members, size=MEMBERS_PAGE_SIZE))
        return render(request, "tpus/_members.html", {"lab": lab, "page": page})
    counts = lab.memberships.aggregate(
        everyone=Count("pk"), waiting=Count("pk", filter=Q(state=MembershipState.REQUESTED))
    )
    # The oldest requests are picked from the lab's requests alone and then joined to
    # their people: sorting the join made PostgreSQL join every request first.
    oldest = lab.memberships.filter(state=MembershipState.REQUESTED).order_by("requested_at", "pk")
    pending = (
        Membership.objects.filter(pk__in=oldest.values("pk")[:REQUESTS_SHOWN])
        .select_related("user")
        .order_by("requested_at", "pk")
    )
    return render(
        request,
        "tpus/lab_admin.html",
        {
            "lab": lab,
            "pending": pending,
            "pending_count": counts["waiting"],
            "filters": filters,
            # Unfiltered, the list is every membership of the lab: counted above.
            "page": _with_standings(
                lab,
                page_of(
                    request,
                    members,
                    size=MEMBERS_PAGE_SIZE,
                    count=None if chosen else lambda: counts["everyone"],
                ),
            ),
            "invites": lab.invites.filter(used_at=None, revoked_at=None),
            "invite_form": InviteForm(),
            "zone_syncs": sync_health.for_lab(lab),
            "allowances": allowances.allowance_use(lab),
        },
    )


@login_required
def people_search(request, slug):
    """The "Give access" picker's matches: at most a screenful of the lab's approved
    members, those not eligible yet marked with the reason."""
    lab = access.get_admin_lab(request.user, slug)
    q = request.GET.get("user", "")
    return render(
        request,
        "tpus/_picker_options.html",
        {
            "options": directory.grantee_candidates(lab, q),
            "q": q,
            "listbox_id": "grant-user-options",
        },
    )


def _membership_row(request, lab, membership, error: str = ""):
    """After an approve/reject: the table row for htmx, or back to the admin page."""
    if is_htmx(request):
        response = render(
            request,
            "tpus/_membership_row.html",
            {"lab": lab, "m": membership, "error": error},
        )
        if not error:  # the member list below reloads itself (with its filters)
            response["HX-Trigger"] = "membersChanged"
        return response
    if error:
        messages.error(request, error)
    return redirect("lab_admin", lab.slug)


@login_required
@require_POST
def membership_approve(request, slug, membership_id):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    try:
        lab_services.approve_membership(request.user, membership, request=request)
    except LabError as exc:
        return _membership_row(request, lab, membership, str(exc))
    if not is_htmx(request):
        messages.success(request, f"{membership.user.email} is now a member.")
    return _membership_row(request, lab, membership)


@login_required
@require_POST
def membership_reject(request, slug, membership_id):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = RejectForm(request.POST)
    if not form.is_valid():
        return _membership_row(request, lab, membership, " ".join(form.errors["note"]))
    try:
        lab_services.reject_membership(
            request.user, membership, note=form.cleaned_data["note"], request=request
        )
    except LabError as exc:
        return _membership_row(request, lab, membership, str(exc))
    return _membership_row(request, lab, membership)


@login_required
@require_POST
def membership_role(request, slug, membership_id):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = RoleForm(request.POST)
    try:
        if not form.is_valid():
            raise LabError("Choose member or lab admin.")
        lab_services.set_role(request.user, membership, form.cleaned_data["role"], request=request)
    except LabError as exc:
        messages.error(request, str(exc))
    return redirect("member_grant", lab.slug, membership.pk)


@login_required
@require_POST
def membership_share(request, slug, membership_id):
    """A lab admin sets a member's share of the lab's pool."""
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    form = ShareForm(request.POST)
    try:
        if not form.is_valid():
            raise fair_share.ShareError(" ".join(form.errors["share"]))
        fair_share.set_share(request.user, membership, form.cleaned_data["share"], request=request)
    except fair_share.ShareError as exc:
        messages.error(request, f"The share was not changed: {exc}")
    else:
        share = form.cleaned_data["share"]
        messages.success(request, f"{membership.user.email}'s share of the pool is {share:g}.")
    return redirect("member_grant", lab.slug, membership.pk)


@login_required
@require_POST
def membership_remove(request, slug, membership_id):
    lab = access.get_admin_lab(request.user, slug)
    membership = access.get_membership_for_admin(request.user, lab, membership_id)
    try:
        lab_services.remove_member(request.user, membership, request=request)
    except LabError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{membership.user.email} was removed from {lab.name}.")
    return redirect("lab_admin", lab.slug)


@login_required
def lab_settings(request, slug):
    """A lab admin edits the lab's own settings; a site admin also its GCP project and
    zones. A lab admin's request that tries to set those is refused outright."""
    lab = access.get_admin_lab(request.user, slug)
    site_admin = request.user.is_site_admin
    if not site_admin and request.POST.keys() & set(lab_services.SITE_ADMIN_FIELDS):
        raise PermissionDenied(lab_services.SITE_ADMIN_ONLY)
    form_class = SiteLabSettingsForm if site_admin else LabSettingsForm
    form = form_class(request.POST or None, instance=lab)
    if request.method == "POST" and form.is_valid():
        # The form validated a copy of the lab; the service applies and records it.
        try:
            lab_services.update_lab(request.user, lab, form.cleaned_data, request=request)
        except LabError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, "Saved.")
            return redirect("lab_admin", lab.slug)
    return render(
        request, "tpus/lab_form.html", {"form": form, "lab": lab, "site_admin": site_admin}
    )


@login_required
def lab_audit(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    page = audit.lab_events(lab, older=request.GET.get("older"), newer=request.GET.get("newer"))
    paged = "older" in request.GET or "newer" in request.GET
    return render(request, "tpus/lab_audit.html", {"lab": lab, "page": page, "paged": paged})


@login_required
@require_POST
def invite_create(request, slug):
    lab = access.get_admin_lab(request.user, slug)
    form = InviteForm(request.POST)
    if form.is_valid():
        try:
            invite, raw = lab_services.create_invite(
                request.user, lab, request=request, **form.cleaned_data
            )
        except LabError as exc:
            messages.error(request, str(exc))
        else:
            link = request.build_absolute_uri(reverse("invite", args=[raw]))
            return render(
                request, "tpus/invite_created.html", {"lab": lab, "invite": invite, "link": link}
            )
    else:
        messages.error(request, " ".join(e for errs in form.errors.values() for e in errs))
    return redirect("lab_admin", lab.slug)


@login_required
@require_POST
def invite_revoke(request, slug, invite_id):
    lab = access.get_admin_lab(request.user, slug)
    invite = access.get_invite_for_admin(request.user, lab, invite_id)
    lab_services.revoke_invite(request.user, invite, request=request)
    messages.success(request, "The invite link no longer works.")
    return redirect("lab_admin", lab.slug)


@login_required
def invite(request, token):
    found = lab_services.find_invite(token)
    form = AcceptInviteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            membership = lab_services.accept_invite(
                request.user, token, accept_policy=True, request=request
            )
        except LabError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, f"Welcome to {membership.lab.name}.")
            return redirect("lab_detail", membership.lab.slug)
    status = 200 if found is not None else 404
    return render(request, "tpus/invite.html", {"invite": found, "form": form}, status=status)

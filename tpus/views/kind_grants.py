"""The lab's kind grants page: give a member every TPU VM of an accelerator type, see
how many VMs each kind grant covers, revoke one; and each kind's elastic pool."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from portal.paging import page_of
from tpus import access
from tpus.forms.elastic import ElasticPoolForm
from tpus.forms.grants import KindGrantForm
from tpus.services import elastic_admin
from tpus.services import kind_grants as kind_services
from tpus.services.grants import GrantError


@login_required
def kind_grants(request, slug):
    """For the lab's admins: "Grant a kind" and the lab's kind grants, a page at a
    time, each with the number of VMs it holds a grant on."""
    lab = access.get_admin_lab(request.user, slug)
    kinds = kind_services.lab_kinds(lab)
    form = KindGrantForm(request.POST or None, lab=lab, kinds=kinds)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            kind = kind_services.grant_kind(
                request.user,
                lab,
                data["user"],
                data["accelerator_type"],
                sudo=data["sudo"],
                expires_on=data["expires_on"],
                request=request,
            )
        except GrantError as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(
                request,
                f"Giving {kind.user.email} every {kind.accelerator_type} of {lab.name}…",
            )
            return redirect("kind_grants", lab.slug)
    return render(
        request,
        "tpus/kind_grants.html",
        {
            "lab": lab,
            "form": form,
            "page": page_of(request, kind_services.kind_grants_of(lab)),
            "pools": elastic_admin.views(lab),
            "pool_form": ElasticPoolForm(lab=lab, kinds=kinds),
        },
    )


@login_required
@require_POST
def elastic_pool_set(request, slug):
    """Switch a kind's elastic pool on or off (lab admins); a refusal names its fields."""
    lab = access.get_admin_lab(request.user, slug)
    form = ElasticPoolForm(request.POST, lab=lab, kinds=kind_services.lab_kinds(lab))
    if not form.is_valid():
        messages.error(request, " ".join(e for errs in form.errors.values() for e in errs))
        return redirect("kind_grants", lab.slug)
    data = form.cleaned_data
    try:
        pool = elastic_admin.set_pool(request.user, lab, request=request, **data)
    except ValidationError as exc:
        messages.error(request, "The elastic pool was not changed: " + " ".join(exc.messages))
    else:
        messages.success(request, elastic_admin.settings_text(pool) + ".")
    return redirect("kind_grants", lab.slug)


@login_required
@require_POST
def kind_grant_revoke(request, slug, kind_grant_id):
    lab = access.get_admin_lab(request.user, slug)
    kind = access.get_kind_grant_for_admin(request.user, lab, kind_grant_id)
    kind_services.revoke_kind_grant(request.user, kind, request=request)
    messages.success(
        request,
        f"Revoking {kind.user.email}'s access to every {kind.accelerator_type} it gave…",
    )
    return redirect("kind_grants", lab.slug)

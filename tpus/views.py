"""Pages about labs and memberships. Each view: one scoped lookup, one form, one
service call, then a redirect or a page."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from tpus.access import admin_labs, visible_labs


@login_required
def dashboard(request):
    memberships = request.user.memberships.select_related("lab").order_by("lab__name")
    return render(
        request,
        "tpus/dashboard.html",
        {"memberships": memberships, "admin_labs": admin_labs(request.user)},
    )


@login_required
def lab_list(request):
    return render(request, "tpus/lab_list.html", {"labs": visible_labs(request.user)})

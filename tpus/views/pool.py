"""Pages of the lab's pool: a job submitted to any free VM of a kind, while it waits
for one (once placed, its page is its VM's job page)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from tpus import access
from tpus.services import jobs as job_services
from tpus.services import scheduler


@login_required
def lab_job(request, slug, job_id):
    """A job of the lab by its id: its VM's job page once it has one; until then what
    it waits for, its place in its kind's line and why it waits."""
    lab = access.get_member_lab(request.user, slug)
    job = access.get_lab_job_for_viewer(request.user, lab, job_id)
    if job.vm_id is not None:
        return redirect("job_detail", lab.slug, job.vm_id, job.pk)
    reason, position = job.reason, None
    if job.is_waiting:
        line = scheduler.waiting_lines(lab.pk, job.accelerator_type).get(job.pk)
        reason, position = (line.reason, line.place) if line else ("", None)
    context = {
        "lab": lab,
        "job": job,
        "reason": reason,
        "position": position,
        "may_cancel": access.may_cancel_job(request.user, job) and job.can_cancel,
    }
    return render(request, "tpus/pool_job.html", context)


@login_required
@require_POST
def lab_job_cancel(request, slug, job_id):
    lab = access.get_member_lab(request.user, slug)
    job = access.get_lab_job_for_viewer(request.user, lab, job_id)
    if not access.may_cancel_job(request.user, job):
        raise PermissionDenied(access.CANCEL_REFUSED)
    if job.vm_id is not None or not job.can_cancel:
        # Placed meanwhile: its VM's page cancels it as any job of that VM.
        return redirect("lab_job", lab.slug, job.pk)
    job_services.cancel_job(job, request.user, request=request)
    messages.success(request, f"Job {job.pk} is cancelled.")
    return redirect("lab_job", lab.slug, job.pk)

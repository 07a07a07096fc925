"""Pages for jobs on TPU VMs: the Jobs section of a VM's page, running a job, a job's
page with each worker's live log, and the lab's TPU usage."""

from __future__ import annotations

import csv
import functools

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.paging import page_of
from tpus import access
from tpus.forms.jobs import JobForm, PeriodForm
from tpus.models import Job
from tpus.models.jobs import JobState, JobWorkerState
from tpus.services import (
    chip_metrics,
    holders,
    idle_holders,
    job_logs,
    sshconfig,
    usage,
    usage_charts,
)
from tpus.services import jobs as job_services

RECENT_JOBS = 10
# What a row of "Recent jobs" reads.
RECENT_JOB_ROW = (
    "vm_id", "state", "script", "args", "queued_at", "ended_at",
    "user__email", "user__unix_account__username",
)  # fmt: skip
# The live log shows the last lines of the tail the portal keeps (the whole log is a
# download away), so a chatty job's page stays light to poll.
LOG_LINES_SHOWN = 300
# Where a job's folder is on a worker (docs/jobs-host.md).
HOST_JOBS_DIR = "/var/lib/tpu-portal/jobs"
# A running worker that has printed nothing for this long gets a word on its part of
# the page: most programs print within seconds, and a pod whose workers cannot reach
# worker 0's coordinator waits in jax.distributed.initialize without a line.
QUIET_AFTER_SECONDS = 60


# --- the VM page's Jobs section --------------------------------------------------------


def vm_jobs_context(user, lab, vm, *, is_admin: bool, may_run: bool) -> dict:
    """What the Jobs section of a VM's page shows: what holds the TPU now, the queue,
    the form for someone who ``may_run`` jobs there (the page knows the viewer's own
    grant), and recent jobs (everyone's for the lab's admins, one's own for others)."""
    recent = (
        Job.objects.filter(vm=vm)
        .select_related("user__unix_account")
        .only(*RECENT_JOB_ROW)  # a job's environment, limits and reason stay behind
    )
    if not is_admin:
        recent = recent.filter(user=user)
    return {
        **_now_context(vm, lab),
        "may_run_jobs": may_run,
        "libtpu_required": settings.PORTAL_JOB_REQUIRE_LIBTPU,
        "job_form": blank_job_form() if may_run else "",
        "recent_jobs": recent.order_by("-queued_at", "-id")[:RECENT_JOBS],
    }


@functools.cache
def blank_job_form() -> str:
    """The empty job form's fields, drawn once per process: they are the same for
    everyone and every VM (no choice or initial value depends on either), and drawing
    a form field by field costs a VM page more than anything else on it."""
    return render_to_string("tpus/_job_form.html", {"form": JobForm()})


def _now_context(vm, lab) -> dict:
    now, queue = usage.vm_now(vm)
    holders.look_when_stale([now])  # someone is looking at this VM
    return {
        "jobs_now": now,
        "jobs_queue": queue,
        "chips_now": chip_metrics.workers_now(
            now.vm, now.running, chip_metrics.duty_means([vm.pk]) if vm.chip_metrics else {}
        ),
        "chips_kept_minutes": settings.PORTAL_CHIP_METRICS_KEEP_MINUTES,
        "refresh_seconds": settings.PORTAL_JOB_USAGE_REFRESH_SECONDS,
        # What the lab's policy on idle chips did here (one query, with the policy on).
        "idle_now": idle_holders.for_vm(vm) if lab.idle_policy_enabled else [],
    }


@login_required
def vm_jobs(request, slug, vm_id):
    """The live part of the Jobs section (htmx): who is using the TPU, the queue."""
    lab = access.get_member_lab(request.user, slug)
    is_admin = access.is_lab_admin(request.user, lab)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id, is_admin=is_admin)
    context = {"lab": lab, "vm": vm, "is_admin": is_admin, **_now_context(vm, lab)}
    return render(request, "tpus/_vm_jobs_now.html", context)


@login_required
def job_submit(request, slug, vm_id):
    """Queue a job; a bad form or a refusal is shown on this page and stores nothing."""
    lab = access.get_member_lab(request.user, slug)
    vm = access.get_vm_for_viewer(request.user, lab, vm_id)
    form = JobForm(request.POST if request.method == "POST" else None)
    status = 200
    pool = request.POST.get("where") == "pool" and bool(vm.accelerator_type)
    if request.method == "POST" and form.is_valid():
        try:
            if pool:
                return _submit_to_pool(request, lab, vm, form)
            job = job_services.submit_job(request.user, vm, form.spec(), request=request)
        except PermissionDenied as exc:
            form.add_error(None, str(exc) or "You may not run jobs on this TPU VM.")
            status = 403
        except ValidationError as exc:
            form.add_service_error(exc)
        else:
            # What happened, not the job's state: the message stays above the live part,
            # which follows the state, and a job that ended never reads as queued.
            messages.success(request, f"Job {job.pk} submitted to {vm.name}.")
            return redirect("job_detail", lab.slug, vm.pk, job.pk)
    context = {
        "lab": lab,
        "vm": vm,
        "form": form,
        "may_run_jobs": job_services.may_run_jobs(request.user, vm),
        "libtpu_required": settings.PORTAL_JOB_REQUIRE_LIBTPU,
    }
    return render(request, "tpus/job_submit.html", context, status=status)


def _submit_to_pool(request, lab, vm, form):
    """ "Run on any free v4-8": the job goes to the lab's pool of VMs of this VM's kind;
    its page says where it waits, then where it runs."""
    kind = job_services.Kind(vm.accelerator_type)
    job = job_services.submit_pool_job(request.user, lab, kind, form.spec(), request=request)
    job.refresh_from_db()
    where = f"to {job.vm.name}" if job.vm_id else f"for any free {vm.accelerator_type}"
    messages.success(request, f"Job {job.pk} submitted {where}.")
    return redirect("lab_job", lab.slug, job.pk)


# --- a job's page ---------------------------------------------------------------------


def _ssh_hosts(user, vm, indexes: list[int]) -> dict[int, str]:
    """Each worker's name in the viewer's ssh config: ``tpu5``, or ``tpu5-w1`` on a
    pod (``sshconfig.entries_for``)."""
    host = sshconfig.host_name_for(user, vm)
    pod = len(indexes) > 1
    return {i: f"{host}-w{i}" if pod else host for i in indexes}


def _live_context(request, lab, job) -> dict:
    parts = list(job.parts.select_related("worker__vm"))
    hosts = _ssh_hosts(request.user, job.vm, [p.index for p in parts])
    now = timezone.now()
    coordinator = job_services.coordinator_of(parts[0].worker) if len(parts) > 1 else ""
    for part in parts:
        part.host = hosts[part.index]
        part.elapsed = (part.ended_at or now) - part.started_at if part.started_at else None
        part.tail_shown = "\n".join(part.log_tail.splitlines()[-LOG_LINES_SHOWN:])
        part.is_running = part.state == JobWorkerState.RUNNING
        part.quiet_for = _quiet_for(part)
    quiet = [p for p in parts if p.quiet_for]
    aliases = {w.index: w.alias for w in job.vm.workers.all()}
    return {
        "lab": lab,
        "vm": job.vm,
        "job": job,
        "parts": parts,
        "quiet": quiet,
        "coordinator": coordinator,
        "log_dir": f"{HOST_JOBS_DIR}/{job.host_id}",
        "position": usage.position(job),
        "preflight": preflight_rows(job.preflight, aliases),
        "preflight_open": job.state in (JobState.REJECTED, JobState.BLOCKED),
        "is_owner": job.user_id == request.user.pk,
        "may_cancel": access.may_cancel_job(request.user, job),
    }


def _quiet_for(part) -> int:
    """Whole seconds a running worker has gone without printing anything, once that is
    QUIET_AFTER_SECONDS or more; else 0."""
    if not part.is_running or part.log_size or part.log_tail or not part.elapsed:
        return 0
    seconds = int(part.elapsed.total_seconds())
    return seconds if seconds >= QUIET_AFTER_SECONDS else 0


def preflight_rows(preflight: dict, aliases: dict[int, str]) -> list[dict]:
    """The pre-flight's checks as one table: a line found alike on several workers is
    one row naming them ("Every worker (4)" when it is on all), failures first."""
    groups: dict[tuple, list[int]] = {}
    for index, checks in sorted(preflight.items(), key=lambda item: int(item[0])):
        for name, status, detail in checks:
            groups.setdefault((name, status, detail), []).append(int(index))
    count = len(preflight)
    rows = []
    for (name, status, detail), indexes in groups.items():
        if count > 1 and len(indexes) == count:
            where = f"Every worker ({count})"
        else:
            where = ", ".join(
                f"{'W' if n == 0 else 'w'}orker {i} ({aliases.get(i, i)})"
                for n, i in enumerate(indexes)
            )
        rows.append({"name": name, "status": status, "detail": detail, "where": where})
    return sorted(rows, key=lambda row: row["status"] != "fail")


@login_required
def job_detail(request, slug, vm_id, job_id):
    lab = access.get_member_lab(request.user, slug)
    job = access.get_job_for_viewer(request.user, lab, vm_id, job_id)
    context = _live_context(request, lab, job)
    if job.is_pool_job and job.state == JobState.LOST:
        # Where its next run went, when it moved to another VM of its kind.
        moved = job.reruns.filter(attempt=job.attempt + 1, returned_at__isnull=False)
        context["moved_to"] = moved.select_related("vm").first()
    return render(request, "tpus/job_detail.html", context)


@login_required
def job_live(request, slug, vm_id, job_id):
    """The part of a job's page that changes (htmx, every 2 s until the job ends)."""
    lab = access.get_member_lab(request.user, slug)
    job = access.get_job_for_viewer(request.user, lab, vm_id, job_id)
    return render(request, "tpus/_job_live.html", _live_context(request, lab, job))


@login_required
def job_log(request, slug, vm_id, job_id, index):
    """One worker's whole log, read from the worker while it downloads."""
    lab = access.get_member_lab(request.user, slug)
    job = access.get_job_for_viewer(request.user, lab, vm_id, job_id)
    part = job.parts.filter(index=index).first()
    if part is None:
        raise Http404("No such worker in this job.")
    if not part.has_log:
        raise Http404("Nothing of this job started on that worker: it has no log.")
    try:
        stream = job_logs.whole_log(job, index)
    except LookupError as exc:
        context = {"lab": lab, "vm": job.vm, "job": job, "index": index, "error": str(exc)}
        return render(request, "tpus/job_log_error.html", context, status=502)
    response = StreamingHttpResponse(stream, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{job_logs.filename(job, index)}"'
    return response


@login_required
@require_POST
def job_cancel(request, slug, vm_id, job_id):
    lab = access.get_member_lab(request.user, slug)
    job = access.get_job_for_viewer(request.user, lab, vm_id, job_id)
    if not access.may_cancel_job(request.user, job):
        raise PermissionDenied(access.CANCEL_REFUSED)
    if not job.can_cancel:
        state = job.get_state_display().lower()
        messages.error(request, f"Job {job.pk} is {state}: there is nothing to cancel.")
    else:
        validating = job.state == JobState.VALIDATING
        job = job_services.cancel_job(job, request.user, request=request)
        if job.has_ended:
            text = f"Job {job.pk} is cancelled."
        elif validating:
            text = f"Cancelling job {job.pk}: it will not start (its checks are stopped)."
        else:
            text = f"Stopping job {job.pk} on every worker…"
        messages.success(request, text)
    return redirect("job_detail", lab.slug, job.vm_id, job.pk)


@login_required
@require_POST
def job_rerun(request, slug, vm_id, job_id):
    lab = access.get_member_lab(request.user, slug)
    job = access.get_job_for_viewer(request.user, lab, vm_id, job_id)
    if job.user_id != request.user.pk:
        raise PermissionDenied("Only the person who submitted a job can run it again.")
    try:
        new = job_services.rerun_job(request.user, job, request=request)
    except (PermissionDenied, ValidationError) as exc:
        text = " ".join(exc.messages) if isinstance(exc, ValidationError) else str(exc)
        messages.error(request, text)
        return redirect("job_detail", lab.slug, job.vm_id, job.pk)
    if new.is_pool_job:
        # Again for any free VM of its kind: its page says where it waits or runs.
        where = f"for any free {new.kind_text}"
        messages.success(request, f"Job {new.pk} submitted {where}: job {job.pk} again.")
        return redirect("lab_job", lab.slug, new.pk)
    messages.success(request, f"Job {new.pk} submitted to {job.vm.name}: job {job.pk} again.")
    return redirect("job_detail", lab.slug, job.vm_id, new.pk)


# --- the lab's TPU usage ---------------------------------------------------------------


def _usage_scope(request, slug):
    lab = access.get_member_lab(request.user, slug)
    is_admin = access.is_lab_admin(request.user, lab)
    form = PeriodForm.of(request.GET)
    return lab, is_admin, form, form.period()


@login_required
def lab_usage(request, slug):
    """What holds each TPU now, and worker-hours per person and per VM over a period,
    with its charts: everyone's for the lab's admins, one's own for members."""
    lab, is_admin, form, period = _usage_scope(request, slug)
    vms = usage.now_vms(
        access.viewable_vms(request.user, lab, is_admin=is_admin).order_by("name", "zone", "pk")
    )
    vm_page = page_of(request, vms, param="vms")
    now = usage.now_for(vm_page.object_list)  # as last seen: reading never looks
    context = {
        "lab": lab,
        "is_admin": is_admin,
        "form": form,
        "period": period,
        "vm_page": vm_page,
        "now": now,
        "definition": usage.WORKER_HOURS,
    }
    if period is not None:
        figures = usage.Usage(lab, period, user=None if is_admin else request.user)
        totals = figures.summary()
        people = usage.MostUsedFirst(figures, "user", totals["people"])
        people = page_of(request, people, param="people")
        per_vm = page_of(request, usage.MostUsedFirst(figures, "vm", totals["vms"]), param="per_vm")
        usage.name_people(people.object_list)
        usage.name_vms(per_vm.object_list)
        charts = usage_charts.for_usage(figures, per_vm.object_list, everyone=is_admin)
        context.update(people=people, per_vm=per_vm, totals=totals, charts=charts)
    return render(request, "tpus/lab_usage.html", context)


@login_required
def lab_usage_csv(request, slug):
    """Worker-hours per person and VM over the period, as CSV."""
    lab, is_admin, form, period = _usage_scope(request, slug)
    if period is None:
        errors = "; ".join(e for field in form.errors.values() for e in field)
        return HttpResponse(errors, status=400, content_type="text/plain; charset=utf-8")
    pairs = usage.Usage(lab, period, user=None if is_admin else request.user).pairs()
    people = {r["id"]: r for r in usage.name_people([{"id": u} for u in {u for u, _ in pairs}])}
    vms = {r["id"]: r for r in usage.name_vms([{"id": v} for v in {v for _, v in pairs}])}
    rows = sorted(
        pairs.items(),
        key=lambda item: (
            people[item[0][0]]["email"],
            vms[item[0][1]]["vm_name"],
            vms[item[0][1]]["zone"],
        ),
    )
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    name = f"tpu-usage-{lab.slug}-{period.first:%Y%m%d}-{period.last:%Y%m%d}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow(["email", "username", "vm", "zone", "jobs", "worker_hours", "from", "to"])
    for (user_id, vm_id), figures in rows:
        person, vm = people[user_id], vms[vm_id]
        writer.writerow(
            [
                _cell(person["email"]),
                _cell(person["username"] or ""),
                _cell(vm["vm_name"]),
                _cell(vm["zone"]),
                figures.jobs,
                f"{usage.hours(figures.total):.2f}",
                period.first.isoformat(),
                period.last.isoformat(),
            ]
        )
    return response


def _cell(text: str) -> str:
    """Text a spreadsheet will not read as a formula (an email may begin with '=')."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text

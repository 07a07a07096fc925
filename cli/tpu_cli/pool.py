"""``tpu run --type v4-8``: a job for any free VM of a kind of the lab (its pool),
followed once the portal has placed it; and the pool's waiting jobs for ``tpu jobs``."""

from __future__ import annotations

import json
import time

from tpu_cli.errors import FAILED, USAGE, ApiError, CliError
from tpu_cli.session import Session, out, say

# How often a job waiting for a VM of its kind is asked about.
WAIT_SECONDS = 2.0


def kind_body(args) -> dict:
    """The kind asked for: ``--type``, ``--zone`` (repeat), ``--spot``/``--on-demand``."""
    provisioning = "spot" if args.spot else "on_demand" if args.on_demand else "any"
    return {"accelerator_type": args.type, "zones": list(args.zone or []),
            "provisioning": provisioning}  # fmt: skip


def lab_of(session: Session, wanted: str | None) -> str:
    """The lab the job goes to: ``--lab``, else the one lab of the person's VMs."""
    if wanted:
        return wanted
    labs = sorted({vm.lab for vm in session.vms()})
    if len(labs) == 1:
        return labs[0]
    if not labs:
        raise CliError("You have access to no TPU VM yet; ask a lab admin.", USAGE)
    raise CliError(f"Say which lab with --lab ({', '.join(labs)}).", USAGE)


def submit(session: Session, lab: str, body: dict) -> dict:
    """Queue the job in the lab's pool; a refusal is the portal's words."""
    return session.api.post(f"/labs/{lab}/jobs", body)


def check(session: Session, lab: str, body: dict) -> None:
    """The portal's refusal of the job (its input, access, the waiting limit) before
    anything is sent; a portal without the check is asked at submit."""
    try:
        session.api.post(f"/labs/{lab}/jobs/validate", body)
    except ApiError as exc:
        if exc.status not in (404, 405):
            raise


IGNORED = (
    "The portal at {url} queued job {job} without its workdir (it did not say the job "
    "carries snapshot {snapshot}: it takes no workdir for a job on any VM of a kind), so "
    "the job was cancelled before it could run without its files. Run on a VM by name "
    "(tpu run VM --workdir …), or ask the portal's admins to update it."
)


def check_carried(session: Session, lab: str, job: dict, snapshot_id: int) -> None:
    """The job the portal queued carries the workdir's snapshot; a portal that took the
    job but not the snapshot (one that ignores fields it does not know) would run the
    command without its files: that job is cancelled and the person told."""
    carried = job.get("snapshot")
    if isinstance(carried, dict) and carried.get("id") == snapshot_id:
        return
    try:
        session.api.post(f"/labs/{lab}/jobs/{job['id']}/cancel")
    except ApiError:
        pass  # said below either way; the job may have ended already
    raise CliError(IGNORED.format(url=session.api.url, job=job["id"], snapshot=snapshot_id), FAILED)


def wait_until_placed(session: Session, lab: str, job: dict) -> dict:
    """Ask about the job until a VM took it or it ended, saying why it waits and its
    place in line whenever they change (Ctrl-C leaves it waiting)."""
    said = ""
    while job["vm_id"] is None and job["state"] in ("queued", "blocked"):
        place = place_text(job)
        text = f"Waiting ({place}): {job['reason']}" if place else f"Waiting: {job['reason']}"
        if job["reason"] and text != said:
            say(text)
            said = text
        time.sleep(WAIT_SECONDS)
        job = session.api.get(f"/labs/{lab}/jobs/{job['id']}")
    return job


def placed_vm(session: Session, job: dict):
    """The person's VM the job was placed on (their list asked again: it may be new)."""
    session._vms = None
    for vm in session.vms():
        if vm.id == job["vm_id"] and vm.lab == job["lab"]:
            return vm
    raise CliError(f"Job {job['id']} runs on {job['vm']}, which is not among your VMs.", 1)


def waiting_rows(session: Session, labs) -> list[dict]:
    """The person's jobs still waiting for a VM of their kind, in each lab."""
    rows = []
    for lab in sorted(set(labs)):
        try:
            jobs = session.api.get(f"/labs/{lab}/jobs")
        except ApiError as exc:
            if exc.status == 404:  # a portal without the pool
                continue
            raise
        for job in jobs:
            job["lab"] = lab
            job["vm"] = f"any {job['accelerator_type']}"
            rows.append(job)
    return rows


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th … 11th, 12th, 13th, 21st."""
    tail = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{tail}"


def place_text(job: dict) -> str:
    """Where a waiting pool job is in its kind's line ("2nd in line"); "" for a job
    that does not wait for a VM, or from a portal that does not say."""
    position = job.get("position")
    if job.get("vm_id", 0) is not None or not isinstance(position, int) or position < 1:
        return ""
    return f"{ordinal(position)} in line"


def move_text(job: dict) -> str:
    """Where a job run again after its VM was lost came from, and why: "run 2; tpu7
    was preempted" ("" for any other job)."""
    attempt, came_from = job.get("attempt"), job.get("moved_from")
    if not came_from:
        return ""
    why = job.get("moved_why") or "lost"
    run = f"run {attempt}; " if isinstance(attempt, int) and attempt > 1 else ""
    return f"{run}{came_from} was {why}"


def notes(job: dict) -> list[str]:
    """What ``tpu jobs`` says of a pool job under its table: why a waiting one waits
    and its place, and where a moved one came from and where it runs now."""
    lines = []
    where = job["vm"] if job.get("vm_id") is not None else f"any {job['accelerator_type']}"
    moved = move_text(job)
    if moved:
        went = (f"it moved to {job['vm']}" if job.get("vm_id") is not None
                else "it waits at the head of the line")  # fmt: skip
        lines.append(f"Job {job['id']} ({moved}): {went}.")
    if job.get("vm_id", 0) is None and job.get("state") in ("queued", "blocked"):
        place = place_text(job)
        reason = job.get("reason") or ""
        head = f"Job {job['id']} ({where}" + (f", {place}" if place else "") + ")"
        if reason or place:
            lines.append(f"{head}: {reason}" if reason else f"{head}.")
    return lines


def my_waiting_by_kind(rows: list[dict], email: str) -> dict[tuple[str, str], dict]:
    """The person's own pool jobs still waiting, per (lab, kind): how many, the best
    place among them, their ids, and how many jobs of the kind the list shows."""
    kinds: dict[tuple[str, str], dict] = {}
    for job in rows:
        key = (job["lab"], job["accelerator_type"])
        kind = kinds.setdefault(key, {"kind": job["accelerator_type"], "lab": job["lab"],
                                      "waiting": 0, "best_place": None, "jobs": [],
                                      "in_line": 0})  # fmt: skip
        kind["in_line"] += 1
        if str(job.get("user", "")).lower() != email.lower():
            continue
        kind["waiting"] += 1
        kind["jobs"].append(job["id"])
        place = job.get("position")
        if isinstance(place, int) and (kind["best_place"] is None or place < kind["best_place"]):
            kind["best_place"] = place
    return {key: kind for key, kind in kinds.items() if kind["waiting"]}


def kind_line(kind: dict) -> str:
    """``tpu ls``'s line for one kind the person's jobs wait for: "vision/any v4-8: 2
    of your jobs wait (7, 9); the first is 1st in line of 3." """
    count, ids = kind["waiting"], ", ".join(str(i) for i in kind["jobs"])
    if count == 1:
        text = f"{kind['lab']}/any {kind['kind']}: your job {ids} waits"
    else:
        text = f"{kind['lab']}/any {kind['kind']}: {count} of your jobs wait ({ids})"
    if kind["best_place"] is not None:
        first = "the first is " if count > 1 else "it is "
        of = f" of {kind['in_line']}" if kind["in_line"] > 1 else ""
        text += f"; {first}{ordinal(kind['best_place'])} in line{of}"
    return text + "."


def unplaced(session: Session, number: str) -> dict | None:
    """The person's own job of that number while it still waits for a VM, else None."""
    if not number.isdigit():
        return None
    try:
        job = session.api.get(f"/me/jobs/{number}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    return job if job.get("vm_id", 0) is None else None


def print_job(job: dict) -> None:
    out.print_json(json.dumps(job))

"""``tpu run --type v4-8``: a job for any free VM of a kind of the lab (its pool),
followed once the portal has placed it; and the pool's waiting jobs for ``tpu jobs``."""

from __future__ import annotations

import json
import time

from tpu_cli.errors import USAGE, ApiError, CliError
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


def wait_until_placed(session: Session, lab: str, job: dict) -> dict:
    """Ask about the job until a VM took it or it ended, saying why it waits whenever
    that changes (Ctrl-C leaves it waiting)."""
    said = ""
    while job["vm_id"] is None and job["state"] in ("queued", "blocked"):
        if job["reason"] and job["reason"] != said:
            say(f"Waiting: {job['reason']}")
            said = job["reason"]
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

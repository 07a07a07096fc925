"""Commands that work on the VMs: run, logs, cancel, jobs, exec, forward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tpu_cli import connections, follow, paths, pool, remote, snapshot, sshfiles
from tpu_cli.errors import FAILED, INTERRUPTED, USAGE, ApiError, CliError
from tpu_cli.session import Session, err, out, say


def _command(args) -> list[str]:
    words = list(args.command or [])
    if not words:
        raise CliError("Give the command after `--`, e.g. tpu run tpu5 -- python3 train.py", USAGE)
    return words


def _workers(vm, worker: str | None) -> dict[int, str]:
    hosts = vm.hosts()
    if worker in (None, "all"):
        return hosts
    if not str(worker).isdigit() or int(worker) not in hosts:
        raise CliError(f"{vm.label} has workers {', '.join(map(str, hosts))}; not {worker}.", USAGE)
    return {int(worker): hosts[int(worker)]}


def remote_folder(local: Path) -> str:
    """Where a workdir goes on the workers: the same path under the home, or for a
    folder outside the home, its name in the home."""
    try:
        return str(local.relative_to(paths.home().resolve())) or "."
    except ValueError:
        return local.name


def worker_path(path: str) -> str:
    """A path on the workers as the person meant it: a shell that expanded ``~/venv``
    to this machine's home gets it back as ``~/venv`` (the workers' home)."""
    mine = str(paths.home())
    if path == mine or path.startswith(mine.rstrip("/") + "/"):
        return "~" + path[len(mine.rstrip("/")) :]
    return path


# --- run ------------------------------------------------------------------------------


def _worker_choice(worker) -> None:
    if worker not in (None, "all") and not str(worker).isdigit():
        raise CliError(f"--worker takes a worker's number (0, 1, …) or all, not {worker!r}.", USAGE)


def run(args) -> int:
    command = _command(args)
    _worker_choice(args.worker)
    env = []
    for item in args.env or []:
        if "=" not in item or item.startswith("="):
            raise CliError(f"--env takes NAME=value, not {item!r}.", USAGE)
        env.append(item)
    local = None
    if args.workdir is not None:
        local = Path(args.workdir).expanduser()
        if not local.is_dir():
            raise CliError(
                f"The workdir {args.workdir} does not exist (or is not a folder).", USAGE
            )
        local = local.resolve()
        if local == paths.home().resolve():
            raise CliError("The workdir is your whole home; choose a project folder.", USAGE)
    pooled = getattr(args, "type", None)
    if bool(pooled) == bool(args.vm):
        raise CliError(
            "Name the VM (tpu run tpu5 -- …) or a kind (tpu run --type v4-8 -- …).", USAGE
        )
    if not pooled and (args.lab or args.zone or args.spot or args.on_demand):
        raise CliError("--lab, --zone, --spot and --on-demand go with --type.", USAGE)
    session = Session()
    if pooled:
        return _run_in_pool(session, args, command, env, local)
    vm = session.vm(args.vm)
    folder = remote_folder(local) if local is not None else ""
    body = {"args": command, "cwd": folder, "python": worker_path(args.venv or ""), "env": env,
            "time_limit_minutes": args.time_limit, "notify": args.notify}  # fmt: skip
    _check(session, vm, body)
    ssh = None
    if local is not None:
        ssh = _ssh(vm)
        sync(vm, local, folder, args.sync, ssh)
    job = session.api.post(f"{vm.api_path}/jobs", body)
    say(f"Job {job['id']} queued on {vm.label}: {job['url']}")
    if args.detach:
        if args.json:
            out.print_json(json.dumps(job))
        return 0
    return _follow(session, vm, job["id"], args.worker, ssh)


def _run_in_pool(
    session: Session, args, command: list[str], env: list[str], local: Path | None
) -> int:
    """``tpu run --type v4-8``: queued for any free VM of the kind; followed on the VM
    the portal gives it. A workdir goes to the portal first as a snapshot, which the
    portal puts at the same folder as a sync would on every worker of that VM."""
    body = {"args": command, "python": worker_path(args.venv or ""), "env": env,
            "time_limit_minutes": args.time_limit, "notify": args.notify,
            **pool.kind_body(args)}  # fmt: skip
    if local is None:
        lab = pool.lab_of(session, args.lab)
    else:
        body["cwd"] = remote_folder(local)
        # The files are hashed while the portal is asked for the lab, and which contents
        # it lacks while it checks the job; a refused job sends no file all the same.
        with ThreadPoolExecutor(max_workers=2) as side:
            listing = side.submit(snapshot.list_workdir, local)
            lab = pool.lab_of(session, args.lab)
            checked = side.submit(pool.check, session, lab, dict(body))
            made = snapshot.upload(
                session.api, lab, local, say, listed=listing.result(), ready=checked.result
            )
        body["snapshot"] = made["id"]
    job = pool.submit(session, lab, body)
    if "snapshot" in body:
        pool.check_carried(session, lab, job, body["snapshot"])
    where = f"on {lab}/{job['vm']}" if job["vm_id"] else f"for any free {args.type} of {lab}"
    say(f"Job {job['id']} queued {where}: {job['url']}")
    if args.detach:
        if args.json:
            pool.print_job(job)
        return 0
    try:
        job = pool.wait_until_placed(session, lab, job)
    except KeyboardInterrupt:
        say(f"\nDetached; job {job['id']} waits on. Cancel it: tpu cancel {job['id']}")
        return INTERRUPTED
    if job["vm_id"] is None:
        say(f"Job {job['id']} {job['state']} before a VM took it.")
        return FAILED
    vm = pool.placed_vm(session, job)
    say(f"Job {job['id']} placed on {vm.label}.")
    return _follow(session, vm, job["id"], args.worker)


def _check(session: Session, vm, body: dict) -> None:
    """The portal's refusal of the job (its input, access, a full queue), before the
    workdir is copied to any worker; a portal without the check is asked at submit."""
    try:
        session.api.post(f"{vm.api_path}/jobs/validate", body)
    except ApiError as exc:
        if exc.status not in (404, 405):
            raise


def _ssh(vm) -> list[str]:
    """The person's ssh for the VM's workers, sharing one connection per worker."""
    hosts = vm.hosts()
    return connections.shared(sshfiles.ssh_base(), hosts[min(hosts)])


def _follow(session: Session, vm, job_id: int, worker, ssh: list[str] | None = None) -> int:
    index = None if worker in (None, "all") else int(worker)
    if ssh is None:
        ssh = _ssh(vm) if vm.ssh is not None and vm.ssh.hosts else sshfiles.ssh_base()
    follower = follow.Follow(session.api, vm, job_id, ssh, say, worker=index)
    try:
        job = follower.run()
    except KeyboardInterrupt:
        say(f"\nDetached; job {job_id} goes on. Follow it again: tpu logs -f {job_id}   "
            f"Cancel it: tpu cancel {job_id}")  # fmt: skip
        return INTERRUPTED
    code = follow.job_exit_code(job)
    if job["state"] == "succeeded":
        say(f"Job {job_id} succeeded.")
    else:
        say(f"Job {job_id} {job['state']}" + (f" (exit code {code})." if code != FAILED else "."))
        for line in follow.why(job):
            say(line)
    return code


def sync(vm, local: Path, folder: str, how: str, ssh: list[str]) -> None:
    hosts = vm.hosts()
    if how == "via-worker0" and len(hosts) > 1:
        _sync_via_worker0(vm, hosts, local, folder, ssh)
        return
    # Imported here, not by every command: rich's progress and tables are slow to import.
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    started = time.monotonic()
    argvs = {i: remote.rsync_argv(ssh, local, host, folder) for i, host in hosts.items()}
    if not err.is_terminal:  # a log file or a pipe gets the summary line alone
        results = remote.sync_parallel(argvs, lambda i, pct: None)
        _report_sync(results, hosts, local, folder, time.monotonic() - started)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                  console=err, transient=False) as progress:  # fmt: skip
        tasks = {i: progress.add_task(f"sync w{i}", total=100) for i in hosts}
        results = remote.sync_parallel(
            argvs, lambda i, pct: progress.update(tasks[i], completed=pct)
        )
    _report_sync(results, hosts, local, folder, time.monotonic() - started)


def _report_sync(results, hosts, local, folder, seconds) -> None:
    failed = {i: r for i, r in results.items() if r.status != 0}
    if failed:
        lines = [f"  w{i} ({hosts[i]}): {_why(r)}" for i, r in sorted(failed.items())]
        raise CliError("Could not sync the workdir to every worker; nothing was run.\n"
                       + "\n".join(lines), FAILED)  # fmt: skip
    moved = sorted({len(r.files) for r in results.values()})
    counts = "/".join(str(n) for n in moved)
    where = "worker 0" if list(results) == [0] and len(hosts) > 1 else f"{len(results)} worker(s)"
    say(f"Synced {local} to ~/{folder} on {where}: {counts} changed file(s), "
        f"{seconds:.1f} s.")  # fmt: skip
    if os.environ.get("TPU_CLI_SHOW_SYNCED"):
        for i, r in sorted(results.items()):
            for name in r.files:
                say(f"  (w{i}) sent {name}")


def _why(result) -> str:
    """Why one worker's rsync failed: what ssh said (it could not connect, a host key
    did not match) before rsync's own last words, which only say that the connection
    closed."""
    said = [line.strip() for line in result.error.splitlines() if line.strip()]
    if not said:
        return f"rsync exited {result.status}"
    shown = [line for line in said if not line.startswith("rsync")][-2:]
    if said[-1] not in shown:
        shown.append(said[-1])
    return "; ".join(shown)


def _sync_via_worker0(vm, hosts, local, folder, ssh) -> None:
    """Laptop -> worker 0, then worker 0 -> the others over the pod's own network, with
    the person's agent forwarded to worker 0 and the others' pinned host keys."""
    started = time.monotonic()
    first = remote.sync_parallel({0: remote.rsync_argv(ssh, local, hosts[0], folder)},
                                 lambda i, pct: None)  # fmt: skip
    _report_sync(first, hosts, local, folder, time.monotonic() - started)
    known = paths.known_hosts_file().read_text(encoding="utf-8")
    user = vm.ssh.user
    prefix = f"tpu-portal.{vm.lab}.{vm.name}" + (f".{vm.ssh.zone}" if vm.ssh.zone else "")
    mine = "".join(line + "\n" for line in known.splitlines() if line.startswith(prefix + ".w"))
    # The pod's own network where the portal knows the workers' internal addresses.
    address = {i: vm.internal_ips.get(i) or vm.ssh.addresses[i] for i in hosts}
    targets = [(i, f"{user}@{address[i]}", f"{prefix}.w{i}") for i in hosts if i != 0]
    script, stdin = remote.via_worker0_command(folder, targets, mine)
    # A connection of its own: through a shared one, the agent forwarded would be that of
    # the command that opened it, not this terminal's.
    plain = sshfiles.ssh_base()
    proc = subprocess.run([*plain, *remote.BATCH, "-A", hosts[0], script], input=stdin.encode(),
                          capture_output=True)  # fmt: skip
    text = proc.stdout.decode(errors="replace")
    failed = re.findall(r"tpu-sync-failed w(\d+)", text)
    if proc.returncode != 0 or failed:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
        which = ", ".join(failed) or "?"
        raise CliError(
            f"Worker 0 could not sync the workdir to worker(s) {which} (is your ssh agent "
            f"running with your key?): {' '.join(detail)}",
            FAILED,
        )
    sent = [line for line in text.splitlines() if re.match(r"^\(w\d+\) [<>]f", line)]
    say(f"Synced from worker 0 to {len(targets)} worker(s): {len(sent)} file copies, "
        f"{time.monotonic() - started:.1f} s in all.")  # fmt: skip


# --- logs, cancel, jobs -------------------------------------------------------------------


def logs(args) -> int:
    _worker_choice(args.worker)
    session = Session()
    vm, job = session.find_job(args.job)
    if args.follow:
        return _follow(session, vm, job["id"], args.worker)
    path = f"{vm.api_path}/jobs/{job['id']}"
    indexes = sorted(p["index"] for p in job["parts"])
    if args.worker not in (None, "all"):
        if not str(args.worker).isdigit() or int(args.worker) not in indexes:
            raise CliError(f"Job {job['id']} has no part on worker {args.worker}.", USAGE)
        indexes = [int(args.worker)]
    if not indexes:
        say(f"Job {job['id']} is {job['state']}: it has no log yet.")
        return 0
    for index in indexes:
        follow.print_whole_log(session.api, path, index, remote.label_for(index, len(indexes) > 1))
    return 0


def cancel(args) -> int:
    session = Session()
    waiting = pool.unplaced(session, args.job)
    if waiting is not None:
        vm, path = None, f"/labs/{waiting['lab']}/jobs/{waiting['id']}/cancel"
    else:
        vm, job = session.find_job(args.job)
        path = f"{vm.api_path}/jobs/{job['id']}/cancel"
    try:
        job = session.api.post(path)
    except ApiError as exc:
        if exc.status == 409:
            raise CliError(exc.detail, FAILED) from None
        raise
    if args.json:
        out.print_json(json.dumps(job))
    else:
        where = vm.label if vm is not None else f"any {job['accelerator_type']}"
        say(f"Job {job['id']} on {where}: {job['state']}.")
    return 0


def jobs(args) -> int:
    session = Session()
    chosen = [session.vm(args.vm, need_active=False)] if args.vm else session.vms()
    since = datetime.now(timezone.utc) - timedelta(days=args.days)
    rows = []
    for vm in chosen:
        changed = since.strftime("%Y-%m-%dT%H:%M:%SZ")
        for job in session.api.pages(f"{vm.api_path}/jobs", updated_since=changed):
            job["lab"] = vm.lab
            rows.append(job)
    if not args.vm:
        rows += pool.waiting_rows(session, [vm.lab for vm in chosen])
    rows.sort(key=lambda j: j["queued_at"], reverse=True)
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    if not rows:
        say(f"No jobs changed in the last {args.days} day(s).")
        return 0
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("JOB", "VM", "WHO", "STATE", "PLACE", "QUEUED", "COMMAND"):
        table.add_column(column)
    for job in rows:
        table.add_row(str(job["id"]), f"{job['lab']}/{job['vm']}", job["username"] or job["user"],
                      job["state"], pool.place_text(job) or "-",
                      job["queued_at"][:16].replace("T", " "),
                      job["command"][:60])  # fmt: skip
    out.print(table)
    # Why each pool job waits, and where a moved one came from: lines of their own
    # (a reason is a sentence; the table stays as wide as it was).
    for job in rows:
        for line in pool.notes(job):
            say(line)
    return 0


# --- exec, forward ------------------------------------------------------------------------


def exec_(args) -> int:
    command = remote.remote_command(_command(args))
    session = Session()
    vm = session.ssh_vm(args.vm)
    hosts = _workers(vm, args.worker)
    codes = remote.run_everywhere(_ssh(vm), hosts, command, label=len(hosts) > 1)
    failed = {i: c for i, c in codes.items() if c != 0}
    if args.json:
        out.print_json(json.dumps({f"w{i}": c for i, c in sorted(codes.items())}))
    if failed:
        which = ", ".join(f"w{i} (exit {c}{', ssh failed' if c == 255 else ''})"
                          for i, c in sorted(failed.items()))  # fmt: skip
        say(f"Failed on {len(failed)} of {len(codes)} worker(s): {which}.")
        return next(iter(failed.values())) if len(codes) == 1 else FAILED
    return 0


def forward(args) -> int:
    found = re.match(r"^(\d{1,5})(?::(\d{1,5}))?$", args.port)
    if not found:
        raise CliError(
            f"Give PORT or PORT:LOCAL (e.g. 6006 or 6006:16006), not {args.port!r}.", USAGE
        )
    port, local = int(found.group(1)), int(found.group(2) or found.group(1))
    for value in (port, local):
        if not 1 <= value <= 65535:
            raise CliError(f"A port is from 1 to 65535, not {value}.", USAGE)
    session = Session()
    vm = session.ssh_vm(args.vm)
    vm.hosts()  # says so when the VM has no address yet
    host = vm.ssh.main
    argv = [*sshfiles.ssh_base(), "-N", "-o", "ExitOnForwardFailure=yes",
            "-L", f"{local}:localhost:{port}", host]  # fmt: skip
    say(f"Forwarding http://localhost:{local} to port {port} on {host}; Ctrl-C stops it.")
    try:
        return subprocess.call(argv)
    except KeyboardInterrupt:
        return 0

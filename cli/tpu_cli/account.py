"""Commands about the person: login, logout, config install, ls, usage."""

from __future__ import annotations

import json
import socket
import sys
import time

from tpu_cli import connections, credentials, paths, pool, sshfiles, vms
from tpu_cli.api import Api
from tpu_cli.errors import FAILED, SIGNED_OUT, UNREACHABLE, USAGE, ApiError, CliError
from tpu_cli.session import Session, out, say


def login(args) -> int:
    url = args.url
    if not url:
        previous = credentials.load()
        url = previous.url if previous else ""
    if not url:
        raise CliError("Give the portal's address: tpu login https://tpu.example.edu", USAGE)
    api = Api(url)
    if args.with_token:
        token = sys.stdin.readline().strip()
        if not token:
            raise CliError(
                "No token on standard input (paste one from the API tokens page).", USAGE
            )
        email = _whose(api.url, token)
    else:
        token, email = _device_flow(api, args.device_name or socket.gethostname(),
                                    open_browser=not args.no_browser)  # fmt: skip
    where = credentials.save(credentials.SignIn(url=api.url, token=token, email=email))
    say(f"Signed in to {api.url} as {email}. (Saved in {where}.)")
    return 0


def _whose(url: str, token: str) -> str:
    try:
        return Api(url, token).get("/me")["email"]
    except CliError as exc:
        if exc.code == SIGNED_OUT:
            raise CliError(
                f"{url} does not accept that token (mistyped, expired or revoked).", SIGNED_OUT
            ) from None
        raise


def _device_flow(api: Api, device_name: str, *, open_browser: bool) -> tuple:
    """RFC 8628: a code to approve on the portal, then poll until it is approved."""
    try:
        codes = api.post("/device/codes", {"device_name": device_name})
    except ApiError as exc:
        if exc.status in (404, 405):
            raise CliError(
                f"{api.url} does not offer browser sign-in; make a token on its API tokens "
                "page and run `tpu login --with-token URL` with it on standard input.",
                USAGE,
            ) from None
        raise
    # The plain page, where the person types the code: a link with the code filled in
    # is what a phisher sends, and the portal's page warns about it.
    link = codes["verification_uri"]
    say(f"Your one-time code: {codes['user_code']}")
    say(f"Type it to approve this device ({device_name}) at: {link}")
    import webbrowser  # only here: every command would pay for importing it

    if open_browser and webbrowser.open(link):
        say("(Opened in your browser.)")
    interval = int(codes.get("interval", 5))
    deadline = time.monotonic() + int(codes.get("expires_in", 600))
    while time.monotonic() < deadline:
        time.sleep(interval)
        try:
            answer = api.post("/device/token", {"device_code": codes["device_code"]})
        except ApiError as exc:
            problem = exc.error_code
            if problem == "authorization_pending":
                continue
            if problem == "slow_down":
                interval += 5
                continue
            if problem == "access_denied":
                raise CliError("The sign-in was refused on the portal.", SIGNED_OUT) from None
            if problem == "expired_token":
                raise CliError("The code expired before it was approved; run `tpu login` "
                               "again.", SIGNED_OUT) from None  # fmt: skip
            raise
        email = answer.get("email") or _whose(api.url, answer["token"])
        return answer["token"], email
    raise CliError("The code expired before it was approved; run `tpu login` again.", SIGNED_OUT)


def logout(args) -> int:
    sign_in = credentials.load()
    if sign_in is None:
        say("You were not signed in.")
        return 0
    try:
        api = Api(sign_in.url, sign_in.token)
    except CliError as exc:  # an address this client no longer talks to (plain http)
        credentials.forget()
        say(f"Signed out of {sign_in.url}; the token was not revoked: {exc.message}")
        say("It stays valid until you revoke it on the portal's API tokens page.")
        return FAILED
    revoked = True
    try:
        _revoke_current(api, sign_in.token)
    except CliError as exc:
        if exc.code == SIGNED_OUT:
            pass  # it had ended already
        elif exc.code == UNREACHABLE:
            revoked = False
            say(f"Could not reach {sign_in.url} to revoke the token ({exc.message}).")
            say("It stays valid until you revoke it on the portal's API tokens page.")
        else:
            raise
    credentials.forget()
    connections.close_shared(sshfiles.ssh_base())
    say(f"Signed out of {sign_in.url}" + (" (the token is revoked)." if revoked else "."))
    return 0 if revoked else FAILED


def _revoke_current(api: Api, token: str) -> None:
    try:
        api.delete("/tokens/current")
        return
    except ApiError as exc:
        if exc.status not in (404, 405, 422):
            raise
    # A portal without /tokens/current: find this token among the person's by its hint.
    for row in api.pages("/tokens"):
        if row["revoked_at"] is None and token.startswith(row["hint"]):
            api.delete(f"/tokens/{row['id']}")
            return


def auth_status(args) -> int:
    """Where the client is signed in, as whom, until when (when the portal says), and
    whether the token still works."""
    sign_in = credentials.load()
    if sign_in is None:
        raise CliError("You are not signed in; run `tpu login URL` first.", SIGNED_OUT)
    api = Api(sign_in.url, sign_in.token)
    status = {"portal": api.url, "email": sign_in.email, "works": False, "expires": None,
              "problem": None}  # fmt: skip
    code = 0
    try:
        status["email"] = api.get("/me").get("email") or sign_in.email
        status["works"] = True
        for row in api.pages("/tokens"):
            if row.get("revoked_at") is None and sign_in.token.startswith(row.get("hint") or "-"):
                status["expires"] = row.get("expires") or row.get("expires_at")
                break
    except CliError as exc:
        if exc.code not in (SIGNED_OUT, UNREACHABLE):
            raise
        status["problem"] = exc.message
        code = exc.code
    if args.json:
        out.print_json(json.dumps(status))
        return code
    out.print(f"Portal:        {status['portal']}", markup=False)
    out.print(f"Signed in as:  {status['email']}", markup=False)
    if status["works"]:
        expires = status["expires"] or "not said by the portal"
        out.print(f"Token:         works (saved in {paths.config_dir()})", markup=False)
        out.print(f"Expires:       {expires}", markup=False)
    elif code == SIGNED_OUT:
        out.print("Token:         no longer works; run `tpu login` again", markup=False)
    else:
        out.print(f"Token:         cannot tell ({status['problem']})", markup=False)
    return code


def config_install(args) -> int:
    session = Session()
    done = session.refresh_ssh(quiet=False)
    backup = sshfiles.ensure_include()
    if args.json:
        out.print_json(json.dumps({
            "config": str(paths.ssh_config_file()), "known_hosts": str(paths.known_hosts_file()),
            "config_changed": done.config_changed, "known_hosts_changed": done.known_hosts_changed,
            "include_added": backup is not None or not sshfiles.include_installed(),
            "backup": str(backup) if backup else None,
        }))  # fmt: skip
        return 0
    say(f"Wrote {paths.ssh_config_file()} and {paths.known_hosts_file()}."
        if done.changed else "Your ssh config and host keys were up to date.")  # fmt: skip
    if backup is not None:
        say(f"Added `{sshfiles.include_line()}` at the top of ~/.ssh/config (the old one is "
            f"{backup}).")  # fmt: skip
    configured = [vm for vm in sshfiles.read_config() if vm.hosts]
    if not configured:
        return 0
    first = configured[0]
    if sshfiles.plain_ssh_finds(first.main, first.addresses.get(0, "")):
        say(f"Now `ssh {first.main}` works; every tpu command keeps the files current.")
        return 0
    home = paths.passwd_home()
    say(f"Plain `ssh` reads {home}/.ssh/config (your home in the password database), not "
        f"{paths.ssh_dir()}/config: there, `ssh -F {paths.ssh_dir()}/config {first.main}` "
        f"works, or add `{sshfiles.include_line()}` at the top of {home}/.ssh/config. The tpu "
        "commands use your files either way.")  # fmt: skip
    return 0


def ls(args) -> int:
    session = Session()
    rows = []
    mine = session.vms(now=True)
    # The person's own jobs waiting for a VM of a kind, per (lab, kind), in each lab of
    # their VMs (the names alone need none of it).
    waiting = {} if args.names else pool.my_waiting_by_kind(
        pool.waiting_rows(session, [vm.lab for vm in mine]), session.sign_in.email
    )  # fmt: skip
    for vm in mine:
        now = vm.now
        running = now.get("job") or None
        rows.append({
            "vm": vm.name, "lab": vm.lab, "id": vm.id, "zone": vm.zone, "access": vm.access,
            "from_kind": vm.from_kind or None,
            "state": vm.state, "workers": vm.workers, "host": vm.ssh.main if vm.ssh else None,
            "address": vm.ssh.addresses.get(0) if vm.ssh else None,
            "addresses": [vm.ssh.addresses[i] for i in sorted(vm.ssh.addresses)] if vm.ssh else [],
            "internal_addresses": [vm.internal_ips[i] for i in sorted(vm.internal_ips)],
            "tpu": now.get("state"),
            "running_job": {"id": running["id"], "user": running["user"],
                            "username": running["username"]} if running else None,
            "holders": now.get("holders", []), "queue_length": now.get("queue_length", 0),
            "chips": _chips_text(now.get("chips")),
            "my_queue_position": vms.queue_position(session.api, vm, session.sign_in.email),
            "accelerator_type": vm.accelerator_type or None,
            # Your jobs waiting for any VM of this one's kind: how many, the best place
            # in the kind's line, their ids (null: none wait).
            "my_pool_jobs": _pool_of(waiting.get((vm.lab, vm.accelerator_type))),
        })  # fmt: skip
    if args.names:
        for row in rows:
            print(row["vm"])
        return 0
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    if not rows:  # (and so no lab whose pool to ask)
        say("You have no access to a TPU VM yet.")
        return 0
    from rich.table import Table  # only where a table is drawn: it is slow to import

    table = Table(box=None, pad_edge=False)
    for column in ("VM", "ACCESS", "STATE", "TPU NOW", "ADDRESS", "WORKERS", "QUEUE",
                   "MY PLACE"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        access = row["access"] + (f" (any {row['from_kind']})" if row["from_kind"] else "")
        table.add_row(f"{row['lab']}/{row['vm']}", access, row["state"] or "-",
                      _now_text(row),
                      row["address"] or "-", str(row["workers"]), str(row["queue_length"]),
                      str(row["my_queue_position"] or "-"))  # fmt: skip
    out.print(table)
    # Each VM's chips in one line of its own (the table stays as wide as it was).
    for row in rows:
        if row["chips"]:
            out.print(f"{row['lab']}/{row['vm']}: {row['chips']}", markup=False, highlight=False)
    # The person's jobs waiting in the pool, a line per kind.
    for _, kind in sorted(waiting.items()):
        out.print(pool.kind_line(kind), markup=False, highlight=False)
    return 0


def _pool_of(kind: dict | None) -> dict | None:
    if not kind:
        return None
    return {"waiting": kind["waiting"], "best_place": kind["best_place"], "jobs": kind["jobs"],
            "in_line": kind["in_line"]}  # fmt: skip


def _now_text(row: dict) -> str:
    if row["state"] not in ("READY", "UNKNOWN", ""):  # preempted, stopped: STATE says so
        return "-"
    if row["tpu"] == "running" and row["running_job"]:
        job = row["running_job"]
        return f"job {job['id']} of {job['username'] or job['user']}"
    if row["tpu"] == "held":
        who = sorted({h["user"] for h in row["holders"]})
        return "held outside the portal" + (f" by {', '.join(who)}" if who else "")
    return row["tpu"] or "-"


def _chips_text(chips) -> str:
    """The VM's chips as the portal last read them, in one line: HBM used of total over
    every chip and their mean duty cycle ("HBM 12/32 GiB, duty 85%"); "" when none
    were read. Only numbers are taken from the portal's answer."""
    summary = chips.get("summary") if isinstance(chips, dict) else None
    if not isinstance(summary, dict):
        return ""
    try:
        used, total, duty = (
            float(summary[k]) for k in ("hbm_used_bytes", "hbm_total_bytes", "duty_cycle_percent")
        )
    except (KeyError, TypeError, ValueError):
        return ""
    if not (0 <= used <= total < 2**60 and 0 <= duty <= 100):
        return ""
    return f"HBM {used / 2**30:.0f}/{total / 2**30:.0f} GiB, duty {duty:.0f}%"


def usage(args) -> int:
    from rich.table import Table

    session = Session()
    session.refresh_ssh()
    params = {k: v for k, v in (("from", args.from_date), ("to", args.to_date)) if v}
    reports = []
    for lab in session.api.pages("/labs"):
        if lab.get("my_state") != "approved":
            continue
        report = session.api.get(f"/labs/{lab['slug']}/usage", **params)
        people = report["people"]
        if people.get("next"):  # the first page came with the totals; the rest, in pages
            rest = session.api.pages(f"/labs/{lab['slug']}/usage/people", **params)
            people["items"] = list(rest)
            people["next"] = None
        people["items"].sort(key=lambda person: (-person["worker_hours"], person["user"]))
        report["lab"] = lab["slug"]
        report["admin"] = lab.get("my_role") == "admin"
        reports.append(report)
    if args.json:
        out.print_json(json.dumps(reports))
        return 0
    for report in reports:
        whose = "everyone's" if report["admin"] else "yours"
        out.print(f"{report['lab']}: {report['worker_hours']:.2f} TPU worker-hours in "
                  f"{report['jobs']} jobs, {report['from_date']} to {report['to_date']} "
                  f"({whose})", markup=False)  # fmt: skip
        table = Table(box=None, pad_edge=False)
        for column in ("PERSON", "JOBS", "WORKER-HOURS"):
            table.add_column(column)
        for person in report["people"]["items"]:
            table.add_row(person["username"] or person["user"], str(person["jobs"]),
                          f"{person['worker_hours']:.2f}")  # fmt: skip
        out.print(table)
    if not reports:
        say("You are in no lab yet.")
    return 0

"""Every page and API list of a big lab, alone and under 32 concurrent clients.

Builds a lab through the models with bulk_create on a throw-away PostgreSQL database
(5,000 users, 500 TPU VMs with about 4,000 workers, 5,000 grants, 5,000 jobs in the last
30 days, 20,000 IP changes, 50,000 audit events by default), runs gunicorn with the
production settings on loopback, signs in over HTTP (the lab admin with a TOTP code
computed by allauth's own helpers), and prints per page: the median of single requests
one after another, p50 and p95 with 32 clients at once, the response size, the queries
the page makes (counted in this process with Django's test client and
CaptureQueriesContext on the same database, not by the server), and the page's p95 over
the p95 of ``/api/v1/me/grants`` in the same run.

    .venv/bin/python -m bench.pages            # full scale, ~5 min
    .venv/bin/python -m bench.pages --small    # a 1/20 lab, a quick check
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from bench.common import POSTGRES_ADMIN_URL, PYTHON, REDIS_URL, ROOT, Stack, table

PASSWORD = "bench pages password"  # noqa: S105 (the throw-away lab's users)
CLIENTS = 32


# --- The lab ---------------------------------------------------------------------------


def build_lab(scale: float) -> dict:
    """The lab, in bulk. Returns the ids and secrets the run needs."""
    from allauth.account.models import EmailAddress
    from allauth.mfa.totp.internal.auth import TOTP, generate_totp_secret
    from django.contrib.auth.hashers import PBKDF2PasswordHasher
    from django.utils import timezone

    from accounts.models import UnixAccount, User
    from tpus.models import AuditEvent, Grant, IpChange, Lab, Membership, TpuVm, Worker
    from tpus.models.audit import AuditAction

    rng = random.Random(15)
    n_users, n_vms = int(5000 * scale), max(int(500 * scale), 4)
    n_grants, n_ips, n_audit = int(5000 * scale), int(20000 * scale), int(50000 * scale)
    zones = ["us-central1-f", "us-central2-b", "europe-west4-a", "us-east1-d", "asia-east1-c"]
    now = timezone.now()
    started = time.monotonic()

    # Hashed once, shared by everyone, with the production settings' hasher.
    hasher = PBKDF2PasswordHasher()
    password = hasher.encode(PASSWORD, hasher.salt())
    users = User.objects.bulk_create(
        [
            User(email=f"person{i}@bench.example", full_name=f"Person {i}", password=password)
            for i in range(n_users)
        ]
    )
    admin, member = users[0], users[1]
    EmailAddress.objects.bulk_create(
        [EmailAddress(user=u, email=u.email, verified=True, primary=True) for u in (admin, member)]
    )
    UnixAccount.objects.bulk_create(
        [UnixAccount(user=u, username=f"p{i}", uid=20000 + i) for i, u in enumerate(users)]
    )
    lab = Lab.objects.create(
        name="Bench Lab", slug="bench", gcp_project_id="bench-project", zones=zones
    )
    Membership.objects.bulk_create(
        [
            Membership(
                lab=lab,
                user=u,
                role="admin" if u is admin else "member",
                state="requested" if i % 20 == 19 else "approved",
                policy_version_accepted=lab.policy_version,
                policy_accepted_at=now,
            )
            for i, u in enumerate(users)
        ]
    )
    # Every 4.5th VM a 32-worker pod, the rest single hosts: ~4,000 workers for 500.
    vms = TpuVm.objects.bulk_create(
        [
            TpuVm(
                lab=lab,
                name=f"tpu{i}",
                zone=zones[i % len(zones)],
                accelerator_type="v4-256" if i % 9 in (0, 4) else "v3-8",
                state="READY",
                health="HEALTHY",
                source="imported",
            )
            for i in range(n_vms)
        ]
    )
    workers = Worker.objects.bulk_create(
        [
            Worker(
                vm=vm,
                index=w,
                internal_ip=f"10.{i // 250}.{i % 250}.{w + 1}",
                external_ip=f"198.18.{i % 250}.{w + 1}",
                # Confirmed host keys, as on a lab's real VMs (the VM's access page
                # then shows the "Give access" form and its counts).
                host_keys=host_keys(rng),
                host_keys_source="guest_attributes",
                host_keys_pinned_at=now,
            )
            for i, vm in enumerate(vms)
            for w in range(32 if vm.accelerator_type == "v4-256" else 1)
        ]
    )
    target = vms[0]  # a 32-worker pod with a crowd on it
    pairs = {(member.pk, vm.pk) for vm in vms[1:14]}
    crowd = rng.sample(users[2:], min(313, n_users - 2))
    pairs |= {(u.pk, target.pk) for u in crowd}
    while len(pairs) < n_grants:
        pairs.add((rng.choice(users).pk, rng.choice(vms).pk))
    Grant.objects.bulk_create(
        [
            Grant(user_id=u, vm_id=v, state="revoked" if rng.random() < 0.1 else "active")
            for u, v in sorted(pairs)
        ]
    )
    n_jobs, counted_in = add_jobs(rng, vms, sorted(pairs), int(5000 * scale), now)
    target_workers = [w for w in workers if w.vm_id == target.pk]
    IpChange.objects.bulk_create(
        [
            IpChange(
                worker=rng.choice(target_workers if i % 10 == 0 else workers),
                old_ip=f"198.19.{i // 250 % 250}.{i % 250}",
                new_ip=f"198.19.{(i + 1) // 250 % 250}.{(i + 1) % 250}",
                seen_at=now - timedelta(minutes=i),
            )
            for i in range(n_ips)
        ],
        batch_size=5000,
    )
    AuditEvent.objects.bulk_create(
        [
            AuditEvent(
                lab=lab,
                actor=admin,
                action=AuditAction.GRANT_CREATED,
                target_user=users[i % n_users],
                summary=f"tpu{i % n_vms}",
                created_at=now - timedelta(seconds=i),
            )
            for i in range(n_audit)
        ],
        batch_size=5000,
    )
    secret = generate_totp_secret()
    TOTP.activate(admin, secret)
    # A database that grew over months has planner statistics (autovacuum keeps them);
    # one filled in seconds by bulk inserts has none until it is analysed.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    seconds = time.monotonic() - started
    print(
        f"Built the lab in {seconds:.1f} s: {len(users)} users, {len(vms)} TPU VMs with "
        f"{len(workers)} workers, {len(pairs)} grants, {n_jobs} jobs in the last 30 days "
        f"(counted into the per-day usage rows in {counted_in:.1f} s), {n_ips} IP changes, "
        f"{n_audit} audit events.\n"
    )
    return {
        "lab": lab,
        "admin": admin,
        "member": member,
        "target": target,
        "member_vm": vms[1],
        "member_membership": Membership.objects.get(lab=lab, user=member).pk,
        "totp_secret": secret,
    }


def add_jobs(rng: random.Random, vms, pairs, count: int, now) -> tuple[int, float]:
    """``count`` jobs over the last 30 days by people with access, on the VMs they may
    use (a pod's job on all 32 workers): most ended, one running on every tenth VM, a
    few queued. Then the ended ones are counted into the per-day usage rows, as the
    job poll does as they end. Returns the jobs made and the seconds the count took."""
    from tpus.models import Job
    from tpus.services import usage

    workers = {vm.pk: 32 if vm.accelerator_type == "v4-256" else 1 for vm in vms}
    jobs = []
    for i in range(count):
        user_id, vm_id = pairs[rng.randrange(len(pairs))]
        ended = now - timedelta(seconds=rng.uniform(60, 30 * 86400))
        started = ended - timedelta(seconds=rng.uniform(600, 8 * 3600))
        state = rng.choice(["succeeded"] * 8 + ["failed", "cancelled"])
        jobs.append(Job(user_id=user_id, vm_id=vm_id, host_id=f"bench-{i}", state=state,
                        args=["python3", "train.py", f"--seed={i}"], queued_at=started,
                        begun_at=started, started_at=started, ended_at=ended, changed_at=ended,
                        worker_count=workers[vm_id]))  # fmt: skip
    granted = {vm_id: user_id for user_id, vm_id in pairs}
    for n, vm in enumerate(vms[::10]):
        user_id = granted.get(vm.pk)
        if user_id is None:
            continue
        started = now - timedelta(minutes=rng.uniform(5, 300))
        jobs.append(Job(user_id=user_id, vm_id=vm.pk, host_id=f"bench-run-{n}",
                        state="running", args=["python3", "train.py"], queued_at=started,
                        begun_at=started, started_at=started, changed_at=started,
                        worker_count=workers[vm.pk]))  # fmt: skip
        for q in range(n % 3):
            jobs.append(Job(user_id=user_id, vm_id=vm.pk, host_id=f"bench-q-{n}-{q}",
                            args=["python3", "train.py"], queued_at=now))  # fmt: skip
    Job.objects.bulk_create(jobs, batch_size=5000)
    began = time.monotonic()
    usage.count_all_ended_jobs()
    return len(jobs), time.monotonic() - began


def host_keys(rng: random.Random) -> list[str]:
    """An ed25519 and an ecdsa host key line, random blobs of the right shape."""
    import base64

    def line(kind: str, size: int) -> str:
        return f"{kind} {base64.b64encode(rng.randbytes(size)).decode()}"

    return [line("ssh-ed25519", 51), line("ecdsa-sha2-nistp256", 104)]


def pages(lab: dict) -> list[tuple[str, str, str]]:
    """(who, name, path) for every page and API list worth driving."""
    s, vm, mvm = lab["lab"].slug, lab["target"].pk, lab["member_vm"].pk
    member_grant = f"/labs/{s}/memberships/{lab['member_membership']}/grant/"
    return [
        ("member", "api me/grants", "/api/v1/me/grants"),
        ("member", "dashboard (member)", "/"),
        ("member", "ssh page", "/ssh/"),
        ("member", "lab page (member)", f"/labs/{s}/"),
        ("member", "VM page (member)", f"/labs/{s}/vms/{mvm}/"),
        ("member", "api labs", "/api/v1/labs"),
        ("member", "api memberships", "/api/v1/memberships"),
        ("member", "api keys", "/api/v1/keys"),
        ("member", "api tokens", "/api/v1/tokens"),
        ("member", "api ip-history (member)", f"/api/v1/labs/{s}/vms/{mvm}/ip-history"),
        ("member", "lab usage (member)", f"/labs/{s}/usage/"),
        ("member", "api labs/{slug}/usage (member)", f"/api/v1/labs/{s}/usage"),
        ("admin", "dashboard (admin)", "/"),
        ("admin", "lab page (admin)", f"/labs/{s}/"),
        ("admin", "lab admin page", f"/labs/{s}/admin/"),
        ("admin", "VM list", f"/labs/{s}/vms/"),
        ("admin", "VM page, 32 workers", f"/labs/{s}/vms/{vm}/"),
        ("admin", "VM access, 32 workers", f"/labs/{s}/vms/{vm}/access/"),
        ("admin", "VM progress partial", f"/labs/{s}/vms/{vm}/progress/"),
        ("admin", "member grant form", member_grant),
        ("admin", "audit log", f"/labs/{s}/audit/"),
        ("admin", "audit log page 500", f"/labs/{s}/audit/?page=500"),
        ("admin", "api labs/{slug}/grants", f"/api/v1/labs/{s}/grants"),
        ("admin", "api labs/{slug}/grants?user=", f"/api/v1/labs/{s}/grants?user=p1"),
        ("admin", "api labs/{slug}/memberships", f"/api/v1/labs/{s}/memberships"),
        ("admin", "api labs/{slug}/vms", f"/api/v1/labs/{s}/vms"),
        ("admin", "api labs/{slug}/disks", f"/api/v1/labs/{s}/disks"),
        ("admin", "api ip-history, 32 workers", f"/api/v1/labs/{s}/vms/{vm}/ip-history"),
        ("admin", "lab usage (admin)", f"/labs/{s}/usage/"),
        ("admin", "api labs/{slug}/usage", f"/api/v1/labs/{s}/usage"),
        ("admin", "api labs/{slug}/usage/people", f"/api/v1/labs/{s}/usage/people"),
        ("admin", "api labs/{slug}/usage/now", f"/api/v1/labs/{s}/usage/now"),
    ]


def count_queries(lab: dict, rows) -> dict[str, int]:
    """Queries per page, with the test client in this process on the same database."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    clients = {}
    for who in ("admin", "member"):
        clients[who] = Client()
        clients[who].force_login(lab[who])
    counts = {}
    for who, name, path in rows:
        clients[who].get(path)  # a first visit may make the lab's key pair
        with CaptureQueriesContext(connection) as context:
            status = clients[who].get(path).status_code
        counts[name] = len(context) if status == 200 else f"HTTP {status}"
    return counts


# --- gunicorn and HTTP ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_gunicorn(stack: Stack, port: int, workers: int) -> subprocess.Popen:
    """gunicorn with the shipped config and the production settings, on loopback."""
    from django.conf import settings

    static_root = stack.dir / "static"
    origin = f"https://127.0.0.1:{port}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PORTAL_TEST", "BENCH_"))},
        "DJANGO_SETTINGS_MODULE": "portal.settings.production",
        "SECRET_KEY": "bench-" + "x7Kq2mP9vR4tY8wZ3nB6cF1hJ5" * 3,
        "PORTAL_SECRETS_KEY": settings.PORTAL_SECRETS_KEY,  # what the seeding encrypted with
        "ALLOWED_HOSTS": "127.0.0.1",
        "SITE_URL": origin,
        "DATABASE_URL": f"{POSTGRES_ADMIN_URL.rsplit('/', 1)[0]}/{stack.database}",
        "CELERY_BROKER_URL": REDIS_URL,
        "CACHE_URL": REDIS_URL,
        "CACHE_KEY_PREFIX": f"bench-{stack.tag}",
        "EMAIL_URL": "console:",
        "STATIC_ROOT": str(static_root),
        "PORTAL_VAR_DIR": str(stack.dir / "var"),
        "PORTAL_BIND": f"127.0.0.1:{port}",
        "PORTAL_WEB_WORKERS": str(workers),
        "LOG_LEVEL": "WARNING",
    }
    subprocess.run(
        [PYTHON, "manage.py", "collectstatic", "--noinput", "-v0"], cwd=ROOT, env=env, check=True
    )
    log = open(stack.dir / "gunicorn.log", "w")
    proc = subprocess.Popen(
        [PYTHON, "-m", "gunicorn", "-c", "portal/gunicorn.conf.py", "portal.wsgi"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    stack.processes.append(("gunicorn", proc, log))
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((stack.dir / "gunicorn.log").read_text()[-3000:]) from None
            time.sleep(0.1)


class Browser:
    """Plain HTTP to gunicorn as if through the TLS proxy (``X-Forwarded-Proto``), with
    the cookies kept by hand: they are Secure, which a client would not send over
    plain HTTP."""

    def __init__(self, port: int):
        import requests

        self.base = f"http://127.0.0.1:{port}"
        self.origin = f"https://127.0.0.1:{port}"
        self.cookies: dict[str, str] = {}
        self.http = requests

    def headers(self) -> dict[str, str]:
        return {
            "X-Forwarded-Proto": "https",
            "Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items()),
            "Origin": self.origin,
            "Referer": self.origin + "/",
        }

    def get(self, path: str):
        response = self.http.get(
            self.base + path, headers=self.headers(), allow_redirects=False, timeout=120
        )
        self.cookies.update(response.cookies.get_dict())
        return response

    def post_form(self, path: str, data: dict):
        page = self.get(path)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, f"no CSRF token on {path}: HTTP {page.status_code}"
        response = self.http.post(
            self.base + path,
            data={**data, "csrfmiddlewaretoken": token.group(1)},
            headers=self.headers(),
            allow_redirects=False,
            timeout=60,
        )
        self.cookies.update(response.cookies.get_dict())
        return response

    def sign_in(self, email: str, totp_secret: str | None = None) -> None:
        response = self.post_form("/accounts/login/", {"login": email, "password": PASSWORD})
        assert response.status_code == 302, f"sign-in of {email}: HTTP {response.status_code}"
        if totp_secret is not None:
            from allauth.mfa.totp.internal.auth import (
                format_hotp_value,
                hotp_value,
                yield_hotp_counters_from_time,
            )

            assert "/2fa/" in response.headers["Location"], response.headers["Location"]
            counter = next(iter(yield_hotp_counters_from_time()))
            code = format_hotp_value(hotp_value(totp_secret, counter))
            response = self.post_form("/accounts/2fa/authenticate/", {"code": code})
            assert response.status_code == 302, f"TOTP of {email}: HTTP {response.status_code}"
        assert self.get("/").status_code == 200, f"{email} is not signed in"


def timed_get(browser: Browser, path: str) -> tuple[float, int, int]:
    started = time.perf_counter()
    response = browser.get(path)
    elapsed = time.perf_counter() - started
    return elapsed, response.status_code, len(response.content)


def drive(
    browser: Browser,
    path: str,
    *,
    alone: int,
    each: int,
    budget: float,
    paired: tuple[Browser, str] | None = None,
) -> dict:
    """Single requests, then ``CLIENTS`` clients at once. With ``paired`` (a browser
    and the reference's path), each client alternates the page and the reference, so
    both are measured in the same seconds, whatever else the machine does then
    (``ref_p95``)."""
    timed_get(browser, path)  # warm-up
    single = [timed_get(browser, path) for _ in range(alone)]
    statuses = {s for _, s, _ in single}
    deadline = time.monotonic() + budget
    samples: list[float] = []
    reference: list[float] = []
    lock = threading.Lock()

    def client(_):
        for _ in range(each):
            if time.monotonic() > deadline:
                return
            elapsed, status, _ = timed_get(browser, path)
            with lock:
                samples.append(elapsed)
                statuses.add(status)
            if paired is not None:
                elapsed, _, _ = timed_get(*paired)
                with lock:
                    reference.append(elapsed)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return {
        "single": statistics.median(t for t, _, _ in single) * 1000,
        "p50": _percentile(samples, 0.5),
        "p95": _percentile(samples, 0.95),
        "ref_p95": _percentile(reference, 0.95) if reference else None,
        "n": len(samples),
        "bytes": single[-1][2],
        "status": ",".join(str(s) for s in sorted(statuses)),
    }


def _percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a 1/20 lab, fewer requests")
    parser.add_argument("--scale", type=float, help="lab size as a fraction of the full one")
    parser.add_argument("--each", type=int, help="requests per client per page (default 4)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per page at most")
    parser.add_argument("--web-workers", type=int, default=4)
    parser.add_argument(
        "--only", help="drive only the pages whose name has this text (and the reference)"
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="each client alternates the page and the reference (ratios from the same "
        "seconds, for a machine that is busy with other work)",
    )
    args = parser.parse_args()
    scale = args.scale or (0.05 if args.small else 1.0)
    each = args.each or (2 if args.small else 4)

    stack = Stack("pages")
    try:
        stack.setup_django()
        lab = build_lab(scale)
        rows = pages(lab)
        if args.only:
            rows = [rows[0], *(row for row in rows[1:] if args.only in row[1])]
        queries = count_queries(lab, rows)
        port = free_port()
        start_gunicorn(stack, port, args.web_workers)
        browsers = {"admin": Browser(port), "member": Browser(port)}
        browsers["admin"].sign_in(lab["admin"].email, lab["totp_secret"])
        browsers["member"].sign_in(lab["member"].email)
        print(
            f"gunicorn: {args.web_workers} sync workers, production settings, 127.0.0.1:{port}; "
            f"{CLIENTS} client threads in this process, {each} requests each per page "
            f"(at most {args.budget:.0f} s a page); single = median of 7 one after another.\n"
        )
        # Every page once from every client first, untimed: the first burst a cold
        # server sees (each gunicorn worker's first connections and templates) would
        # otherwise land on whichever page is driven first, the reference.
        with ThreadPoolExecutor(CLIENTS) as pool:
            for who, _, path in rows:
                list(pool.map(browsers[who].get, [path] * CLIENTS))
        results = {}
        for n, (who, name, path) in enumerate(rows):
            paired = (browsers["member"], rows[0][2]) if args.paired and n else None
            results[name] = drive(
                browsers[who], path, alone=7, each=each, budget=args.budget, paired=paired
            )
            print(f"  {name}: p95 {results[name]['p95']:.0f} ms", file=sys.stderr)
        reference = results["api me/grants"]["p95"]
        # The reference again after every other page: how steady the machine was.
        again = drive(browsers["member"], rows[0][2], alone=7, each=each, budget=args.budget)
        print(
            table(
                [
                    "page",
                    "single ms",
                    "p50 ms @32",
                    "p95 ms @32",
                    "n",
                    "bytes",
                    "queries",
                    "p95 / me/grants p95",
                    *(["me/grants p95 beside", "p95 / that"] if args.paired else []),
                    "HTTP",
                ],
                [
                    [
                        name,
                        round(r["single"], 1),
                        round(r["p50"]),
                        round(r["p95"]),
                        r["n"],
                        r["bytes"],
                        queries[name],
                        round(r["p95"] / reference, 1),
                        *(
                            [
                                round(r["ref_p95"] or r["p95"]),
                                round(r["p95"] / (r["ref_p95"] or r["p95"]), 1),
                            ]
                            if args.paired
                            else []
                        ),
                        r["status"],
                    ]
                    for name, r in results.items()
                ],
            )  # fmt: skip
        )
        print(
            f"\napi me/grants driven again after every other page: p50 {again['p50']:.0f} ms, "
            f"p95 {again['p95']:.0f} ms (the ratios use the first, {reference:.0f} ms)."
        )
    finally:
        stack.close()  # stops gunicorn by its pid, drops the database


if __name__ == "__main__":
    main()

"""The API's lists page with limit + cursor and filter, the same way everywhere."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.models import UnixAccount
from tpus.models import Grant, IpChange, Membership, TpuVm, Worker, WorkerSync
from tpus.services import grants as grant_services
from tpus.services import labs as lab_services

ZONE = "us-central1-f"


@pytest.fixture
def lab_with_grants(cast, make_user):
    """tpu5 (us-central1-f) and tpu6 (europe-west4-a) in the cast's lab, and a grant
    on tpu5 for each of ``n`` new members; another lab with grants of its own."""
    cast.lab.zones = [ZONE, "europe-west4-a"]
    cast.lab.save()
    tpu5 = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone=ZONE, source="manual")
    tpu6 = TpuVm.objects.create(lab=cast.lab, name="tpu6", zone="europe-west4-a", source="manual")
    theirs = TpuVm.objects.create(lab=cast.other_lab, name="tpu9", zone=ZONE, source="manual")
    for vm in (tpu5, tpu6, theirs):
        Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.1")
    Grant.objects.create(user=cast.outsider, vm=theirs, state="active")
    counter = iter(range(1000))

    def grow(n, vm=tpu5, state="active"):
        made = []
        for _ in range(n):
            i = next(counter)
            user = make_user(f"member{i}@vision.example")
            Membership.objects.create(lab=cast.lab, user=user, state="approved")
            UnixAccount.objects.create(user=user, username=f"member{i}", uid=40_000 + i)
            made.append(Grant.objects.create(user=user, vm=vm, state=state))
        return made

    grow.tpu5, grow.tpu6, grow.theirs = tpu5, tpu6, theirs
    return grow


def _get(client, url, status=200):
    response = client.get(url)
    assert response.status_code == status, response.content
    return response.json()


def _walk(client, url, between_pages=None):
    seen, pages = [], 0
    while url:
        page = _get(client, url)
        seen += [item["id"] for item in page["items"]]
        url, pages = page["next"], pages + 1
        if between_pages:
            between_pages(pages)
    return seen, pages


def test_a_cursor_walk_visits_every_grant_once_while_grants_are_added(
    client, cast, lab_with_grants
):
    before = {g.pk for g in lab_with_grants(7)}
    added = set()
    client.force_login(cast.admin)

    def add_some(pages):
        if pages <= 2:
            added.update(g.pk for g in lab_with_grants(2))

    seen, pages = _walk(client, f"/api/v1/labs/{cast.lab.slug}/grants?limit=3", add_some)

    assert len(seen) == len(set(seen))
    assert set(seen) == before | added
    assert pages == 4  # 11 grants, 3 a page; the last page has no next


def test_the_next_link_is_absolute_and_keeps_the_filters(client, cast, lab_with_grants):
    lab_with_grants(3)
    lab_with_grants(2, state="revoked")
    client.force_login(cast.admin)

    page = _get(client, f"/api/v1/labs/{cast.lab.slug}/grants?state=active&limit=2")

    assert page["total"] == 3 and len(page["items"]) == 2
    assert page["next"].startswith(f"http://testserver/api/v1/labs/{cast.lab.slug}/grants?")
    assert "state=active" in page["next"] and "limit=2" in page["next"]
    last = _get(client, page["next"])
    assert [g["state"] for g in last["items"]] == ["active"]
    assert last["next"] is None and last["total"] == 3


def test_a_lab_list_never_shows_another_labs_grants_whatever_the_cursor(
    client, cast, lab_with_grants
):
    lab_with_grants(2)
    client.force_login(cast.admin)
    # A cursor from before every row of both labs.
    cursor = base64.urlsafe_b64encode(b"k1.1").decode().rstrip("=")

    seen, _ = _walk(client, f"/api/v1/labs/{cast.lab.slug}/grants?limit=1&cursor={cursor}")

    assert set(seen) == set(Grant.objects.filter(vm__lab=cast.lab).values_list("pk", flat=True))
    assert Grant.objects.get(vm=lab_with_grants.theirs).pk not in seen


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=201",
        "limit=ten",
        "limit=-1",
        "cursor=garbage",
        "cursor=" + base64.urlsafe_b64encode(b"k1.abc").decode(),
        "cursor=" + base64.urlsafe_b64encode(b"k1.99999999999999999999").decode(),
        "state=enabled",
        "user=nobody@vision.example",
        "user=eve@other.example",  # a member of another lab only
        "vm=tpu9",  # another lab's VM, by name
        "vm=999999",
        "zone=mars-north1-a",
        "updated_since=yesterday",
        "status=active",  # a misspelt filter must not return everything
    ],
)
def test_bad_paging_or_filter_values_are_a_400_that_says_which(
    client, cast, lab_with_grants, query
):
    lab_with_grants(1)
    client.force_login(cast.admin)

    body = _get(client, f"/api/v1/labs/{cast.lab.slug}/grants?{query}", status=400)

    assert query.split("=")[0] in body["detail"]


def test_another_labs_vm_by_id_is_refused_like_a_vm_that_does_not_exist(
    client, cast, lab_with_grants
):
    client.force_login(cast.admin)
    theirs = _get(
        client, f"/api/v1/labs/{cast.lab.slug}/grants?vm={lab_with_grants.theirs.pk}", status=400
    )
    missing = _get(client, f"/api/v1/labs/{cast.lab.slug}/grants?vm=999999", status=400)
    assert theirs["detail"].replace(str(lab_with_grants.theirs.pk), "N") == missing[
        "detail"
    ].replace("999999", "N")


def test_grants_filter_by_user_email_or_username_vm_id_or_name_and_zone(
    client, cast, lab_with_grants
):
    milo_grant, other = lab_with_grants(2)
    on_tpu6 = lab_with_grants(1, vm=lab_with_grants.tpu6)[0]
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/grants"

    def ids(query):
        return [g["id"] for g in _get(client, f"{url}?{query}")["items"]]

    assert ids(f"user={milo_grant.user.email.upper()}") == [milo_grant.pk]
    assert ids(f"user={milo_grant.user.unix_account.username}") == [milo_grant.pk]
    assert ids("vm=tpu6") == ids(f"vm={lab_with_grants.tpu6.pk}") == [on_tpu6.pk]
    assert ids("zone=europe-west4-a") == [on_tpu6.pk]
    assert ids(f"zone={ZONE}") == [milo_grant.pk, other.pk]


def test_grants_changed_since_a_moment_include_revoked_ones_and_no_others(
    client, cast, lab_with_grants
):
    old, revoked = lab_with_grants(2)
    Grant.objects.update(changed_at=timezone.now() - timedelta(days=2))
    moment = timezone.now() - timedelta(hours=1)
    grant_services.revoke_access(cast.admin, revoked)
    client.force_login(cast.admin)

    page = _get(
        client,
        f"/api/v1/labs/{cast.lab.slug}/grants?updated_since={moment:%Y-%m-%dT%H:%M:%S}Z",
    )

    assert [g["id"] for g in page["items"]] == [revoked.pk]
    assert old.pk not in [g["id"] for g in page["items"]]


def test_a_decision_on_a_membership_counts_as_a_change(client, cast):
    Membership.objects.update(changed_at=timezone.now() - timedelta(days=2))
    moment = (timezone.now() - timedelta(hours=1)).isoformat()
    lab_services.approve_membership(cast.admin, cast.pending_membership)
    client.force_login(cast.admin)

    page = _get(
        client,
        f"/api/v1/labs/{cast.lab.slug}/memberships",
        status=200,
    )
    changed = client.get(
        f"/api/v1/labs/{cast.lab.slug}/memberships", {"updated_since": moment}
    ).json()

    assert page["total"] == 3
    assert [m["user"] for m in changed["items"]] == ["pat@vision.example"]


def test_memberships_filter_by_state_role_and_user(client, cast):
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/memberships"

    def users(query):
        return [m["user"] for m in _get(client, f"{url}?{query}")["items"]]

    assert users("state=requested") == ["pat@vision.example"]
    assert users("role=admin") == ["admin@vision.example"]
    assert users("user=milo@vision.example") == ["milo@vision.example"]
    assert "someone@other.example" not in users("limit=200")
    assert "role" in _get(client, f"{url}?role=owner", status=400)["detail"]


def test_vms_and_disks_filter_by_state_and_zone(client, cast, lab_with_grants):
    TpuVm.objects.filter(pk=lab_with_grants.tpu6.pk).update(state="STOPPED")
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/vms"

    assert [v["name"] for v in _get(client, url)["items"]] == ["tpu5", "tpu6"]
    assert [v["name"] for v in _get(client, f"{url}?state=STOPPED")["items"]] == ["tpu6"]
    assert [v["name"] for v in _get(client, f"{url}?zone={ZONE}")["items"]] == ["tpu5"]
    assert _get(client, f"{url}?zone=asia-east1-c", status=400)
    disks = _get(client, f"/api/v1/labs/{cast.lab.slug}/disks?vm=tpu5")
    assert disks == {"items": [], "next": None, "total": 0}


def test_a_vm_in_the_list_is_the_vm_itself_without_its_workers_host_keys(
    client, cast, lab_with_grants
):
    pod = lab_with_grants.tpu6
    now = timezone.now()
    Worker.objects.filter(vm=pod).update(internal_ip="10.0.0.1", host_keys=["ssh-ed25519 AAAA"])
    alarmed = Worker.objects.create(
        vm=pod, index=1, host_key_mismatch_at=now, presented_host_key="ssh-ed25519 BBBB"
    )
    Worker.objects.create(vm=pod, index=2, external_ip="192.0.2.3")  # never reconciled
    WorkerSync.objects.create(worker=pod.workers.get(index=0), applied_version=3,
                              last_success_at=now - timedelta(minutes=1))  # fmt: skip
    WorkerSync.objects.create(worker=alarmed, last_error="unreachable", last_error_retryable=True)
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/vms"

    [listed] = [v for v in _get(client, url)["items"] if v["id"] == pod.pk]
    alone = _get(client, f"{url}/{pod.pk}")
    for worker in alone["workers"]:
        del worker["host_keys"], worker["presented_host_key"]
    del alone["chips"]  # the chips' metrics too are in the VM's own object only
    assert listed == alone
    assert [(w["alias"], w["applied_version"], w["last_error"], w["last_error_retryable"])
            for w in listed["workers"]] == [
        ("tpu6-w0", 3, "", False), ("tpu6-w1", 0, "unreachable", True), ("tpu6-w2", None, "", False)
    ]  # fmt: skip


def test_ip_history_pages_without_a_total_and_filters_by_time(client, cast, lab_with_grants):
    worker = lab_with_grants.tpu5.workers.get()
    long_ago = timezone.now() - timedelta(days=30)
    IpChange.objects.bulk_create(
        [
            IpChange(worker=worker, old_ip=f"192.0.2.{i}", new_ip=f"192.0.2.{i + 1}",
                     seen_at=long_ago + timedelta(days=i))
            for i in range(5)
        ]
    )  # fmt: skip
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/vms/{lab_with_grants.tpu5.pk}/ip-history"

    first = _get(client, f"{url}?limit=2")
    recent = client.get(url, {"updated_since": (long_ago + timedelta(days=3)).isoformat()}).json()

    assert "total" not in first and len(first["items"]) == 2 and first["next"]
    assert [c["new_ip"] for c in recent["items"]] == ["192.0.2.4", "192.0.2.5"]


def test_my_own_lists_page_too(client, cast, lab_with_grants):
    grant = lab_with_grants(1)[0]
    client.force_login(grant.user)

    for url in ("/api/v1/me/grants", "/api/v1/memberships", "/api/v1/labs", "/api/v1/keys",
                "/api/v1/tokens"):  # fmt: skip
        page = _get(client, f"{url}?limit=1")
        assert set(page) == {"items", "next", "total"}, url
    assert _get(client, "/api/v1/me/grants?state=active")["items"][0]["id"] == grant.pk
    assert _get(client, "/api/v1/me/grants?state=revoked")["total"] == 0
    assert _get(client, "/api/v1/me/grants?vm=tpu5", status=400)


@pytest.mark.parametrize("path", ["grants", "memberships", "vms"])
def test_a_page_costs_the_same_queries_for_two_rows_as_for_fifty(
    client, cast, lab_with_grants, path
):
    lab_with_grants(60)
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/{path}"
    for index in range(1, 4):  # workers, so the VM list has something to prefetch
        Worker.objects.create(vm=lab_with_grants.tpu6, index=index)

    def queries(limit):
        with CaptureQueriesContext(connection) as context:
            _get(client, f"{url}?limit={limit}")
        return len(context)

    assert queries(2) == queries(50)


def test_a_settled_grant_counts_its_vms_workers_and_only_grants_in_flight_load_them(
    client, cast, lab_with_grants
):
    pod = lab_with_grants.tpu6
    for index in range(1, 4):
        Worker.objects.create(vm=pod, index=index)
    [active] = lab_with_grants(1, vm=pod)
    [pending] = lab_with_grants(1, vm=lab_with_grants.tpu5, state="pending")
    client.force_login(cast.admin)
    loaded = []

    def record(sender, instance, **kwargs):
        loaded.append(instance.vm_id)

    post_init.connect(record, sender=Worker)
    try:
        items = {g["id"]: g for g in _get(client, "/api/v1/labs/vision/grants")["items"]}
    finally:
        post_init.disconnect(record, sender=Worker)
    assert (items[active.pk]["workers_total"], items[active.pk]["workers_applied"]) == (4, 4)
    assert items[active.pk]["workers"] == []
    assert (items[pending.pk]["workers_total"], items[pending.pk]["workers_applied"]) == (1, 0)
    assert [w["state"] for w in items[pending.pk]["workers"]] == ["waiting"]
    # Only the worker of the VM with a grant in flight was read, not the pod's four.
    assert loaded == [lab_with_grants.tpu5.pk]


def test_a_page_of_settled_grants_reads_no_workers(client, cast, lab_with_grants):
    lab_with_grants(3)
    [pending] = lab_with_grants(1, vm=lab_with_grants.tpu6, state="pending")
    client.force_login(cast.admin)
    url = f"/api/v1/labs/{cast.lab.slug}/grants"

    def worker_reads(query):
        with CaptureQueriesContext(connection) as context:
            _get(client, f"{url}?{query}")
        return [q for q in context.captured_queries if q["sql"].startswith('SELECT "tpus_worker"')]

    assert worker_reads("state=active") == []
    assert len(worker_reads("")) == 1  # the pending grant's VM's workers, for its standing
    [item] = _get(client, f"{url}?state=pending")["items"]
    assert (item["id"], item["workers_total"], item["workers_applied"]) == (pending.pk, 1, 0)


def test_my_grants_name_each_vms_lab_state_and_workers_addresses(client, cast, lab_with_grants):
    pod = lab_with_grants.tpu6
    pod.state, pod.accelerator_type = "PREEMPTED", "v4-16"
    pod.save(update_fields=["state", "accelerator_type"])
    Worker.objects.filter(vm=pod).update(internal_ip="10.0.0.2")
    Worker.objects.create(vm=pod, index=1, internal_ip="10.0.0.3", external_ip="192.0.2.2")
    Grant.objects.create(user=cast.member, vm=pod, state="active")
    Grant.objects.create(user=cast.member, vm=lab_with_grants.tpu5, state="revoked")
    client.force_login(cast.member)

    items = {g["vm"]: g for g in _get(client, "/api/v1/me/grants")["items"]}

    assert (items["tpu6"]["lab"], items["tpu6"]["zone"]) == ("vision", "europe-west4-a")
    assert items["tpu6"]["vm_state"] == "PREEMPTED"
    assert items["tpu6"]["accelerator_type"] == "v4-16"
    assert items["tpu6"]["vm_workers"] == [
        {"index": 0, "alias": "tpu6-w0", "internal_ip": "10.0.0.2", "external_ip": "192.0.2.1"},
        {"index": 1, "alias": "tpu6-w1", "internal_ip": "10.0.0.3", "external_ip": "192.0.2.2"},
    ]
    # Access that ended shows where the VM was, not where its workers are now.
    assert items["tpu5"]["lab"] == "vision" and items["tpu5"]["vm_workers"] == []


def test_a_page_of_my_grants_costs_the_same_queries_for_two_rows_as_for_fifty(client, cast):
    for n in range(60):
        vm = TpuVm.objects.create(lab=cast.lab, name=f"pod{n}", zone=ZONE, source="manual")
        Worker.objects.bulk_create(Worker(vm=vm, index=i) for i in range(4))
        Grant.objects.create(user=cast.member, vm=vm, state="active" if n % 2 else "pending")
    client.force_login(cast.member)

    def queries(limit):
        with CaptureQueriesContext(connection) as context:
            page = _get(client, f"/api/v1/me/grants?limit={limit}")
        assert all(len(g["vm_workers"]) == 4 for g in page["items"])
        return len(context)

    assert queries(2) == queries(50)


def test_an_admins_list_of_grants_names_the_lab_too(client, cast, lab_with_grants):
    lab_with_grants(2)
    client.force_login(cast.admin)
    items = _get(client, f"/api/v1/labs/{cast.lab.slug}/grants")["items"]
    assert [g["lab"] for g in items] == ["vision", "vision"]
    assert "vm_workers" not in items[0]

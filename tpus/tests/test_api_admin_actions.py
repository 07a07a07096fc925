"""What a lab admin does on the pages, through the API: members' roles and removal, lab
settings, the audit log, invites, "Refresh", and registering a disk or (site admins) a
TPU VM by hand. The same checks as the pages: another lab's object is a 404, a member
who is not an admin a 403 with the reason, bad input a 400 naming the fields, with
nothing stored."""

from __future__ import annotations

import datetime as dt
from urllib.parse import urlsplit

import pytest
from django.core import mail
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.services import create_token
from accounts.unix import choose_username
from portal import audit
from tpus.models import AuditAction, AuditEvent, DataDisk, Grant, Invite, Lab, TpuVm, Worker
from tpus.services import inventory
from tpus.services import labs as lab_services
from tpus.services.inventory import MANUAL_SITE_ADMIN_ONLY
from tpus.services.labs import SITE_ADMIN_ONLY

ZONE = "us-central1-f"
ADMINS_ONLY = "Only the lab's admins can do that."


@pytest.fixture
def token_for(db):
    def make(user):
        return {"HTTP_AUTHORIZATION": f"Bearer {create_token(user, 'test')[1]}"}

    return make


@pytest.fixture
def call(client, token_for):
    """``call(user, method, url, body)``: one API request with that person's token."""

    def send(user, method, url, body=None):
        auth = token_for(user)
        if method == "get":
            return client.get(url, **auth)
        return getattr(client, method)(url, body or {}, content_type="application/json", **auth)

    return send


def _url(slug, suffix):
    return f"/api/v1/labs/{slug}/{suffix}"


def _snapshot():
    """Everything an admin action could change, to show that a refusal changed nothing."""
    return {
        "memberships": sorted(
            Lab.objects.values_list("memberships__pk", "memberships__state", "memberships__role")
        ),
        "labs": sorted(
            Lab.objects.values_list(
                "pk",
                "name",
                "policy_text",
                "policy_version",
                "zones",
                "grant_end_date",
                "discoverable",
            )  # fmt: skip
        ),
        "invites": sorted(Invite.objects.values_list("pk", "revoked_at")),
        "disks": DataDisk.objects.count(),
        "vms": TpuVm.objects.count(),
        # Every call makes its own token, which is audited; nothing else may be.
        "audit": AuditEvent.objects.exclude(action=AuditAction.TOKEN_CREATED).count(),
    }


def _endpoints(membership, invite):
    """Every new endpoint, with a body that would succeed for the lab's admins."""
    return [
        ("post", f"memberships/{membership.pk}/role", {"role": "admin"}),
        ("post", f"memberships/{membership.pk}/remove", None),
        ("get", "settings", None),
        ("patch", "settings", {"policy_text": "Changed."}),
        ("get", "audit", None),
        ("get", "invites", None),
        ("post", "invites", {"email": "new@uni.example"}),
        ("post", f"invites/{invite.pk}/revoke", None),
        ("post", "refresh", None),
        ("post", "disks/register", {"name": "imagenet", "zone": ZONE}),
        (
            "post",
            "vms/register",
            {
                "name": "tpu9",
                "zone": ZONE,
                "accelerator_type": "v3-8",
                "workers": [{"external_ip": "192.0.2.99"}],
            },
        ),
    ]


# --- Who may: a member is told why not; another lab's objects do not exist ----------


def test_a_member_who_is_not_an_admin_is_refused_each_action_with_the_reason(
    cast, call, django_capture_on_commit_callbacks
):
    invite, _ = lab_services.create_invite(cast.admin, cast.lab)
    before = _snapshot()
    with django_capture_on_commit_callbacks() as queued:
        for method, suffix, body in _endpoints(cast.pending_membership, invite):
            response = call(cast.member, method, _url(cast.lab.slug, suffix), body)
            assert response.status_code == 403, (method, suffix, response.content)
            assert response.json() == {"detail": ADMINS_ONLY}, suffix
    assert _snapshot() == before
    assert queued == []


@pytest.mark.parametrize("who", ["outsider", "pending"])
def test_someone_not_in_the_lab_gets_a_404_for_every_action(
    cast, call, who, django_capture_on_commit_callbacks
):
    """The admin of another lab, or someone whose request to join is still pending."""
    invite, _ = lab_services.create_invite(cast.admin, cast.lab)
    before = _snapshot()
    with django_capture_on_commit_callbacks() as queued:
        for method, suffix, body in _endpoints(cast.member_membership, invite):
            response = call(getattr(cast, who), method, _url(cast.lab.slug, suffix), body)
            assert response.status_code == 404, (method, suffix, response.content)
    assert _snapshot() == before
    assert queued == []


@pytest.mark.parametrize(
    "suffix, body",
    [
        ("memberships/{membership}/role", {"role": "admin"}),
        ("memberships/{membership}/remove", None),
        ("invites/{invite}/revoke", None),
    ],
)
def test_another_labs_membership_or_invite_is_a_404_whichever_lab_the_url_names(
    cast, call, add_member, suffix, body
):
    theirs = add_member(cast.other_lab, cast.member)
    their_invite, _ = lab_services.create_invite(cast.outsider, cast.other_lab)
    before = _snapshot()
    path = suffix.format(membership=theirs.pk, invite=their_invite.pk)
    for slug in (cast.lab.slug, cast.other_lab.slug):
        response = call(cast.admin, "post", _url(slug, path), body)
        assert response.status_code == 404, (slug, response.content)
    assert _snapshot() == before


# --- Members -------------------------------------------------------------------------


def test_an_admin_makes_a_member_a_lab_admin_and_back(cast, call):
    url = _url(cast.lab.slug, f"memberships/{cast.member_membership.pk}/role")
    response = call(cast.admin, "post", url, {"role": "admin"})
    assert response.status_code == 200, response.content
    assert response.json()["role"] == "admin"
    cast.member_membership.refresh_from_db()
    assert cast.member_membership.role == "admin"
    assert call(cast.admin, "post", url, {"role": "member"}).json()["role"] == "member"
    changes = AuditEvent.objects.filter(action=AuditAction.ROLE_CHANGED, lab=cast.lab)
    assert [e.data["role"] for e in changes.order_by("pk")] == ["admin", "member"]
    assert {e.target_user for e in changes} == {cast.member}


@pytest.mark.parametrize("body", [{"role": "owner"}, {"role": ""}])
def test_a_role_that_does_not_exist_is_refused_by_field(cast, call, body):
    before = _snapshot()
    url = _url(cast.lab.slug, f"memberships/{cast.member_membership.pk}/role")
    response = call(cast.admin, "post", url, body)
    assert response.status_code == 400
    assert list(response.json()["errors"]) == ["role"]
    assert response.json()["detail"].startswith("role: ")
    assert _snapshot() == before


def test_the_last_admin_cannot_step_down_or_be_removed(cast, call):
    mine = cast.lab.memberships.get(user=cast.admin)
    before = _snapshot()
    for suffix, body in ((f"memberships/{mine.pk}/role", {"role": "member"}),
                         (f"memberships/{mine.pk}/remove", None)):  # fmt: skip
        response = call(cast.admin, "post", _url(cast.lab.slug, suffix), body)
        assert response.status_code == 400
        assert response.json() == {
            "detail": "A lab needs at least one admin; make someone else admin first.",
            "errors": {},
        }
    assert _snapshot() == before


def test_a_pending_request_has_no_role_to_change(cast, call):
    url = _url(cast.lab.slug, f"memberships/{cast.pending_membership.pk}/role")
    response = call(cast.admin, "post", url, {"role": "admin"})
    assert response.status_code == 400
    assert "Only approved members" in response.json()["detail"]
    cast.pending_membership.refresh_from_db()
    assert cast.pending_membership.role == "member"


def test_removing_a_member_revokes_their_access_to_the_labs_vms(
    cast, call, django_capture_on_commit_callbacks
):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone=ZONE, source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10")
    choose_username(cast.member, "milo")
    grant = Grant.objects.create(user=cast.member, vm=vm, state="active")
    url = _url(cast.lab.slug, f"memberships/{cast.member_membership.pk}/remove")
    with django_capture_on_commit_callbacks() as queued:  # the reconcile: not run here
        response = call(cast.admin, "post", url)
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "removed"
    grant.refresh_from_db()
    assert grant.state == "revoking"
    assert queued, "the VM's reconcile is queued"
    assert AuditEvent.objects.filter(
        action=AuditAction.MEMBERSHIP_REMOVED, lab=cast.lab, target_user=cast.member
    ).exists()
    # Removing again is the same answer, and nothing more happens.
    again = call(cast.admin, "post", url)
    assert again.status_code == 200 and again.json()["state"] == "removed"
    assert AuditEvent.objects.filter(action=AuditAction.MEMBERSHIP_REMOVED).count() == 1


# --- Settings ------------------------------------------------------------------------


def test_an_admin_reads_the_labs_settings(cast, call):
    response = call(cast.admin, "get", _url(cast.lab.slug, "settings"))
    assert response.status_code == 200
    body = response.json()
    assert body["name"] == "Vision Lab" and body["zones"] == [ZONE]
    assert body["discoverable"] is False and body["policy_version"] == 1


def test_changing_the_policy_changes_only_it_and_members_accept_the_new_version(cast, call):
    before = Lab.objects.get(pk=cast.lab.pk)
    response = call(
        cast.admin, "patch", _url(cast.lab.slug, "settings"), {"policy_text": "Research only."}
    )
    assert response.status_code == 200, response.content
    assert response.json()["policy_text"] == "Research only."
    assert response.json()["policy_version"] == 2
    lab = Lab.objects.get(pk=cast.lab.pk)
    assert (lab.policy_text, lab.policy_version) == ("Research only.", 2)
    assert (lab.name, lab.zones, lab.discoverable, lab.grant_end_date) == (
        before.name,
        before.zones,
        before.discoverable,
        before.grant_end_date,
    )
    event = AuditEvent.objects.get(action=AuditAction.LAB_UPDATED)
    assert (event.actor, event.data) == (cast.admin, {"fields": ["policy_text"]})


def test_settings_take_booleans_and_a_date_and_null_clears_the_date(cast, call):
    url = _url(cast.lab.slug, "settings")
    body = {"default_sudo": True, "discoverable": True}
    assert call(cast.admin, "patch", url, body).status_code == 200
    body = {"grant_end_date": "2026-03-01"}  # the grant's end: a site admin's to set
    assert call(cast.site_admin, "patch", url, body).status_code == 200
    lab = Lab.objects.get(pk=cast.lab.pk)
    assert (lab.default_sudo, lab.discoverable, lab.grant_end_date) == (
        True,
        True,
        dt.date(2026, 3, 1),
    )
    assert call(cast.site_admin, "patch", url, {"grant_end_date": None}).status_code == 200
    assert Lab.objects.get(pk=cast.lab.pk).grant_end_date is None


@pytest.mark.parametrize(
    "body, fields, fragment",
    [
        ({"name": ""}, ["name"], "required"),
        ({"name": "x" * 101}, ["name"], "at most 100"),
        ({"name": "Vision\x1b[2J"}, ["name"], "control characters"),
        ({"policy_text": "a\x07b"}, ["policy_text"], "control characters"),
        ({"policy_text": "a\x00b"}, ["policy_text"], "null characters"),
        ({"name": "", "policy_text": "a\x07b"}, ["name", "policy_text"], "name: "),
    ],
)
def test_bad_settings_are_refused_field_by_field_and_nothing_is_stored(
    cast, call, body, fields, fragment
):
    before = _snapshot()
    response = call(cast.admin, "patch", _url(cast.lab.slug, "settings"), body)
    assert response.status_code == 400, response.content
    assert sorted(response.json()["errors"]) == fields
    assert fragment.lower() in response.json()["detail"].lower()
    assert _snapshot() == before


@pytest.mark.parametrize(
    "body, loc",
    [
        ({"polcy_text": "Research only."}, "polcy_text"),
        ({"default_sudo": "sure"}, "default_sudo"),
        ({"name": None}, "name"),
        ({"grant_end_date": "next spring"}, "grant_end_date"),
    ],
)
def test_a_body_of_the_wrong_shape_names_the_field_and_changes_nothing(cast, call, body, loc):
    before = _snapshot()
    response = call(cast.admin, "patch", _url(cast.lab.slug, "settings"), body)
    assert response.status_code == 422
    assert [error["loc"][-1] for error in response.json()["detail"]] == [loc]
    assert _snapshot() == before


@pytest.mark.parametrize(
    "body",
    [
        {"gcp_project_id": "another-project"},
        {"zones": [ZONE, "europe-west4-a"]},
        {"grant_end_date": "2099-12-31"},
        {"grant_end_date": None, "discoverable": True},
    ],
)
def test_only_a_site_admin_moves_the_lab_to_another_project_or_zones_or_its_grant_end(
    cast, call, body
):
    before = _snapshot()
    response = call(cast.admin, "patch", _url(cast.lab.slug, "settings"), body)
    assert response.status_code == 403
    assert response.json() == {"detail": SITE_ADMIN_ONLY}
    assert _snapshot() == before
    response = call(cast.site_admin, "patch", _url(cast.lab.slug, "settings"), body)
    assert response.status_code == 200, response.content
    lab = Lab.objects.get(pk=cast.lab.pk)
    field, value = next(iter(body.items()))
    stored = getattr(lab, field)
    stored = stored.isoformat() if isinstance(stored, dt.date) else stored
    assert stored == value == response.json()[field]


@pytest.mark.parametrize(
    "zones",
    [["us-central1-f europe-west4-a"], ["us-central1-f,europe-west4-a"], [ZONE, ""], ["mars"]],
)
def test_a_zone_list_item_that_is_not_one_zone_is_refused(cast, call, zones):
    before = _snapshot()
    response = call(cast.site_admin, "patch", _url(cast.lab.slug, "settings"), {"zones": zones})
    assert response.status_code == 400, response.content
    assert response.json()["errors"] == {
        "zones": ["A zone looks like us-central1-f or europe-west4-a."]
    }
    assert _snapshot() == before


def test_a_project_another_lab_has_is_refused_by_field(cast, call):
    before = _snapshot()
    response = call(
        cast.site_admin,
        "patch",
        _url(cast.lab.slug, "settings"),
        {"gcp_project_id": cast.other_lab.gcp_project_id},
    )
    assert response.status_code == 400
    assert "belongs to another lab" in response.json()["errors"]["gcp_project_id"][0]
    assert _snapshot() == before


# --- Audit log -----------------------------------------------------------------------


def _walk(call, user, url):
    """Every item of a list, following ``next`` page by page."""
    items, pages = [], 0
    while url:
        response = call(user, "get", url)
        assert response.status_code == 200, response.content
        page = response.json()
        assert "total" not in page
        items += page["items"]
        url, pages = page["next"], pages + 1
    return items, pages


def test_the_audit_log_is_walked_oldest_first_each_event_once_and_only_this_labs(cast, call):
    for n in range(7):
        audit.record(AuditAction.LAB_UPDATED, actor=cast.admin, lab=cast.lab, summary=f"v{n}")
        audit.record(AuditAction.LAB_UPDATED, actor=cast.outsider, lab=cast.other_lab)
    items, pages = _walk(call, cast.admin, _url(cast.lab.slug, "audit?limit=3"))
    assert pages == 3
    assert [e["summary"] for e in items] == [f"v{n}" for n in range(7)]
    ids = [e["id"] for e in items]
    assert ids == sorted(set(ids))
    first = items[0]
    assert first["action"] == "lab.updated" and first["action_label"] == "Lab settings changed"
    assert first["actor"] == "admin@vision.example" and first["user"] is None


def test_the_audit_log_shows_what_the_api_actions_did(cast, call):
    call(
        cast.admin, "post", _url(cast.lab.slug, f"memberships/{cast.pending_membership.pk}/approve")
    )
    call(cast.site_admin, "patch", _url(cast.lab.slug, "settings"), {"discoverable": True})
    items, _ = _walk(call, cast.admin, _url(cast.lab.slug, "audit"))
    assert [(e["action"], e["actor"], e["user"]) for e in items] == [
        ("membership.approved", "admin@vision.example", "pat@vision.example"),
        ("lab.updated", "root@portal.example", None),
    ]
    assert items[1]["data"] == {"fields": ["discoverable"]}
    assert items[0]["ip_address"] == "127.0.0.1"


def test_the_audit_log_filters_by_action_actor_person_and_time(cast, call):
    audit.record(AuditAction.MEMBERSHIP_APPROVED, actor=cast.admin, lab=cast.lab,
                 target_user=cast.member)  # fmt: skip
    audit.record(AuditAction.LAB_UPDATED, actor=cast.site_admin, lab=cast.lab)
    since = timezone.now()
    audit.record(AuditAction.GRANT_CREATED, actor=cast.admin, lab=cast.lab,
                 target_user=cast.member)  # fmt: skip
    audit.record(AuditAction.VM_RECONCILED, lab=cast.lab)  # by the portal itself

    def actions(query):
        items, _ = _walk(call, cast.admin, _url(cast.lab.slug, f"audit?{query}"))
        return [e["action"] for e in items]

    assert actions("action=lab.updated") == ["lab.updated"]
    # A site admin acted in the lab without being a member: still someone to ask for.
    assert actions("actor=root@portal.example") == ["lab.updated"]
    assert actions("actor=ADMIN@vision.example") == ["membership.approved", "grant.created"]
    choose_username(cast.member, "milo")
    assert actions("user=milo") == ["membership.approved", "grant.created"]
    stamp = since.isoformat().replace("+00:00", "Z")
    assert actions(f"updated_since={stamp}") == ["grant.created", "vm.reconciled"]
    assert actions(f"updated_since={stamp}&actor=admin@vision.example") == ["grant.created"]


@pytest.mark.parametrize(
    "query, named",
    [
        ("action=lab.exploded", "action"),
        ("actor=eve@other.example", "actor"),  # the other lab's admin
        ("actor=nobody@nowhere.example", "actor"),
        ("user=someone@other.example", "user"),
        ("updated_since=yesterday", "updated_since"),
        ("since=2025-01-01T00:00:00Z", "since"),
        ("limit=0", "limit"),
    ],
)
def test_an_audit_filter_that_cannot_match_is_a_400_naming_it(cast, call, query, named):
    response = call(cast.admin, "get", _url(cast.lab.slug, f"audit?{query}"))
    assert response.status_code == 400
    assert named in response.json()["detail"]


def test_someone_who_never_acted_in_the_lab_is_no_actor_whether_or_not_they_exist(cast, call):
    """The filter does not tell a lab admin who else has an account."""
    unknown = call(cast.admin, "get", _url(cast.lab.slug, "audit?actor=nobody@nowhere.example"))
    stranger = call(cast.admin, "get", _url(cast.lab.slug, "audit?actor=someone@other.example"))
    assert unknown.json()["detail"].replace("nobody@nowhere", "X") == stranger.json()[
        "detail"
    ].replace("someone@other", "X")


def test_a_page_of_the_audit_log_costs_the_same_queries_however_many_events(cast, client):
    def queries(events):
        for _ in range(events):
            audit.record(AuditAction.GRANT_CREATED, actor=cast.admin, lab=cast.lab,
                         target_user=cast.member)  # fmt: skip
        auth = {"HTTP_AUTHORIZATION": f"Bearer {create_token(cast.admin, 'q')[1]}"}
        with CaptureQueriesContext(connection) as captured:
            response = client.get(_url(cast.lab.slug, "audit?limit=200"), **auth)
        assert response.status_code == 200
        return len(captured)

    assert queries(2) == queries(60)


# --- Invites -------------------------------------------------------------------------


def test_an_invite_link_is_shown_once_and_joins_the_lab(cast, call, client, make_user):
    response = call(cast.admin, "post", _url(cast.lab.slug, "invites"), {"role": "admin"})
    assert response.status_code == 201, response.content
    created = response.json()
    assert (created["state"], created["role"], created["email"]) == ("open", "admin", "")
    assert created["created_by"] == "admin@vision.example"
    link = urlsplit(created["link"])
    assert (link.scheme, link.netloc) == ("http", "testserver")
    # The list never shows the link again: only its hash is kept.
    listed = call(cast.admin, "get", _url(cast.lab.slug, "invites")).json()
    assert [i["id"] for i in listed["items"]] == [created["id"]] and listed["total"] == 1
    assert "link" not in listed["items"][0]
    assert link.path.split("/")[-2] not in Invite.objects.get().digest
    assert AuditEvent.objects.filter(action=AuditAction.INVITE_CREATED, lab=cast.lab).exists()
    newcomer = make_user("ada@uni.example")
    client.force_login(newcomer)
    assert client.post(link.path, {"accept_policy": "on"}).status_code == 302
    membership = cast.lab.memberships.get(user=newcomer)
    assert (membership.state, membership.role) == ("approved", "admin")
    [used] = call(cast.admin, "get", _url(cast.lab.slug, "invites?state=used")).json()["items"]
    assert (used["state"], used["used_by"]) == ("used", "ada@uni.example")


def test_an_invite_for_an_address_is_emailed_to_it(cast, call, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = call(
            cast.admin, "post", _url(cast.lab.slug, "invites"), {"email": "Ada@Uni.example"}
        )
    assert response.status_code == 201
    assert response.json()["email"] == "ada@uni.example"
    [message] = [m for m in mail.outbox if m.to == ["ada@uni.example"]]
    assert urlsplit(response.json()["link"]).path in message.body


@pytest.mark.parametrize(
    "body, field",
    [
        ({"email": "not an address"}, "email"),
        ({"role": "owner"}, "role"),
        ({"email": "a@b.example\nBcc: eve@evil.example"}, "email"),
    ],
)
def test_a_bad_invite_is_refused_by_field_and_nothing_is_stored(cast, call, body, field):
    before = _snapshot()
    response = call(cast.admin, "post", _url(cast.lab.slug, "invites"), body)
    assert response.status_code == 400, response.content
    assert list(response.json()["errors"]) == [field]
    assert _snapshot() == before
    assert not Invite.objects.exists()


def test_a_revoked_invite_link_stops_working(cast, call, client, make_user):
    created = call(cast.admin, "post", _url(cast.lab.slug, "invites"), {}).json()
    url = _url(cast.lab.slug, f"invites/{created['id']}/revoke")
    response = call(cast.admin, "post", url)
    assert response.status_code == 200
    assert response.json()["state"] == "revoked" and response.json()["revoked_at"]
    # Revoking again changes nothing and records nothing more.
    assert call(cast.admin, "post", url).json()["revoked_at"] == response.json()["revoked_at"]
    assert AuditEvent.objects.filter(action=AuditAction.INVITE_REVOKED).count() == 1
    client.force_login(make_user("ada@uni.example"))
    client.post(urlsplit(created["link"]).path, {"accept_policy": "on"})
    assert not cast.lab.memberships.filter(user__email="ada@uni.example").exists()


def test_invites_are_listed_by_state(cast, call):
    opened, _ = lab_services.create_invite(cast.admin, cast.lab)
    revoked, _ = lab_services.create_invite(cast.admin, cast.lab)
    lab_services.revoke_invite(cast.admin, revoked)
    expired, _ = lab_services.create_invite(cast.admin, cast.lab, email="late@uni.example")
    Invite.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    lab_services.create_invite(cast.outsider, cast.other_lab)  # another lab's

    def listed(query=""):
        page = call(cast.admin, "get", _url(cast.lab.slug, f"invites{query}")).json()
        return {i["id"]: i["state"] for i in page["items"]}

    assert listed() == {opened.pk: "open", revoked.pk: "revoked", expired.pk: "expired"}
    for state, invite in (("open", opened), ("revoked", revoked), ("expired", expired)):
        assert listed(f"?state={state}") == {invite.pk: state}
    response = call(cast.admin, "get", _url(cast.lab.slug, "invites?state=lost"))
    assert response.status_code == 400 and "state" in response.json()["detail"]


# --- Refresh, disks and VMs ----------------------------------------------------------


def test_refresh_queues_the_labs_sync_which_then_sees_an_ip_change(
    cast, call, tpu_emulator, django_capture_on_commit_callbacks
):
    lab = cast.lab
    lab.gcp_project_id = "vision-lab-1"
    lab.save()
    tpu_emulator.controls.add_node("vision-lab-1", ZONE, "tpu5", workers=1,
                                   external_ips=["34.0.0.1"])  # fmt: skip
    [vm] = inventory.import_vms(cast.admin, lab, [f"{ZONE}/tpu5"])
    tpu_emulator.controls.set_ip("tpu5", 0, "34.0.0.9")
    with django_capture_on_commit_callbacks() as queued:
        response = call(cast.admin, "post", _url(lab.slug, "refresh"))
    assert response.status_code == 202, response.content
    body = response.json()
    assert [row["zone"] for row in body["sync"]] == [ZONE]
    assert body["sync"][0]["last_success_at"] is None
    # Nothing was listed during the request: the sync runs after it, as a task.
    assert vm.workers.get().external_ip == "34.0.0.1"
    assert len(queued) == 1
    with django_capture_on_commit_callbacks(execute=True):
        queued[0]()
    assert vm.workers.get().external_ip == "34.0.0.9"
    [row] = call(cast.admin, "get", f"/api/v1/labs/{lab.slug}").json()["sync"]
    assert row["last_success_at"] > body["queued_at"]


def test_a_disk_is_registered_in_one_of_the_labs_zones(cast, call):
    body = {"name": "imagenet", "zone": ZONE, "size_gb": 500}
    response = call(cast.admin, "post", _url(cast.lab.slug, "disks/register"), body)
    assert response.status_code == 201, response.content
    assert response.json() == {
        "id": DataDisk.objects.get().pk,
        "name": "imagenet",
        "zone": ZONE,
        "size_gb": 500,
        "mount_point": "/ssd",
        "attachments": [],
    }
    assert DataDisk.objects.get().lab == cast.lab
    event = AuditEvent.objects.get(action=AuditAction.DISK_REGISTERED)
    assert (event.lab, event.actor, event.summary) == (cast.lab, cast.admin, "imagenet")
    # The same name in the same zone again: the service's refusal, nothing stored.
    again = call(cast.admin, "post", _url(cast.lab.slug, "disks/register"), body)
    assert again.status_code == 400 and again.json()["errors"] == {}
    assert "already exists" in again.json()["detail"]
    assert DataDisk.objects.count() == 1


@pytest.mark.parametrize(
    "change, fields",
    [
        ({"name": "ImageNet; rm -rf /"}, ["name"]),
        ({"zone": "europe-west4-a"}, ["zone"]),  # not one of the lab's zones
        ({"size_gb": 0}, ["size_gb"]),
        ({"mount_point": "../etc"}, ["mount_point"]),
        ({"name": "", "mount_point": "/"}, ["mount_point", "name"]),
    ],
)
def test_a_bad_disk_is_refused_by_field_and_nothing_is_stored(cast, call, change, fields):
    before = _snapshot()
    body = {"name": "imagenet", "zone": ZONE, **change}
    response = call(cast.admin, "post", _url(cast.lab.slug, "disks/register"), body)
    assert response.status_code == 400, response.content
    assert sorted(response.json()["errors"]) == fields
    assert _snapshot() == before


def _manual(**change):
    return {
        "name": "tpu9",
        "zone": ZONE,
        "accelerator_type": "v4-16",
        "workers": [
            {"external_ip": "34.1.2.3", "internal_ip": "10.0.0.2"},
            {"external_ip": "34.1.2.4"},
        ],
        **change,
    }


def test_a_site_admin_registers_a_vm_by_hand_with_its_workers_in_order(cast, call):
    response = call(cast.site_admin, "post", _url(cast.lab.slug, "vms/register"), _manual())
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["name"], body["source"], body["accelerator_type"]) == ("tpu9", "manual", "v4-16")
    assert [(w["index"], w["external_ip"], w["internal_ip"]) for w in body["workers"]] == [
        (0, "34.1.2.3", "10.0.0.2"),
        (1, "34.1.2.4", None),
    ]
    vm = TpuVm.objects.get(name="tpu9")
    assert vm.lab == cast.lab
    assert list(vm.workers.order_by("index").values_list("external_ip", "host_keys")) == [
        ("34.1.2.3", []),
        ("34.1.2.4", []),
    ]
    assert AuditEvent.objects.filter(action=AuditAction.VM_REGISTERED, actor=cast.site_admin)


def test_a_lab_admin_may_not_register_a_vm_by_hand_and_is_told_why(cast, call):
    before = _snapshot()
    response = call(cast.admin, "post", _url(cast.lab.slug, "vms/register"), _manual())
    assert response.status_code == 403
    assert response.json() == {"detail": MANUAL_SITE_ADMIN_ONLY}
    assert _snapshot() == before


@pytest.mark.parametrize(
    "change, field, fragment",
    [
        ({"name": "TPU 9; reboot"}, "name", "A TPU VM name"),
        ({"accelerator_type": "v3-8 && id"}, "accelerator_type", "accelerator type"),
        ({"zone": "mars-north1-a"}, "zone", "Select a valid choice"),
        ({"workers": []}, "workers", "This field is required"),
        ({"workers": [{"external_ip": "$(reboot)"}]}, "workers", "Line 1: '$(reboot)'"),
        # Two addresses in one field would read as external + internal on the page.
        ({"workers": [{"external_ip": "34.1.2.3 10.0.0.2"}]}, "workers", "Line 1:"),
        ({"workers": [{"external_ip": "34.1.2.3"}, {"external_ip": ""}]}, "workers", "Line 2:"),
        (
            {"workers": [{"external_ip": "34.1.2.3", "internal_ip": "10.0.0.2\n34.9.9.9"}]},
            "workers",
            "Line 1:",
        ),
    ],
)
def test_a_bad_manual_registration_is_refused_by_field_and_nothing_is_stored(
    cast, call, change, field, fragment
):
    before = _snapshot()
    response = call(cast.site_admin, "post", _url(cast.lab.slug, "vms/register"), _manual(**change))
    assert response.status_code == 400, response.content
    assert list(response.json()["errors"]) == [field]
    assert fragment in response.json()["errors"][field][0]
    assert _snapshot() == before
    assert not Worker.objects.exists()


def test_an_address_of_another_labs_worker_is_refused(cast, call):
    theirs = TpuVm.objects.create(lab=cast.other_lab, name="tpu1", zone=ZONE, source="manual")
    Worker.objects.create(vm=theirs, index=0, external_ip="34.1.2.4")
    before = _snapshot()
    response = call(cast.site_admin, "post", _url(cast.lab.slug, "vms/register"), _manual())
    assert response.status_code == 400
    assert "belongs to a worker of another lab" in response.json()["detail"]
    assert _snapshot() == before

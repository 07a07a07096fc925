"""The lists that grow with a lab come a page at a time, searched and filtered, with
links that keep the filters; members see only what concerns them."""

from __future__ import annotations

import datetime as dt
import gzip
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from accounts.models import UnixAccount
from portal import audit
from tpus.models import AuditAction, AuditEvent, Grant, Membership, TpuVm, Worker


@pytest.fixture
def people(cast, make_user):
    """55 approved members (member00…member54) and 3 pending requests in the lab."""
    for i in range(55):
        user = make_user(f"member{i:02}@vision.example", full_name=f"Person {i:02}")
        Membership.objects.create(lab=cast.lab, user=user, state="approved")
        UnixAccount.objects.create(user=user, username=f"member{i:02}", uid=31_000 + i)
    for i in range(3):
        user = make_user(f"asker{i}@vision.example")
        Membership.objects.create(lab=cast.lab, user=user, state="requested")


def _body(client, url, **headers) -> str:
    response = client.get(url, **headers)
    assert response.status_code == 200
    return response.content.decode()


def test_the_members_list_shows_25_at_a_time_and_pages_keep_the_search(client, cast, people):
    client.force_login(cast.admin)
    url = reverse("lab_admin", args=[cast.lab.slug])
    first = _body(client, url + "?q=member&state=approved")
    assert first.count('id="member-') == 25
    assert "1–25 of 55" in first
    assert "?q=member&amp;state=approved&amp;page=2" in first
    last = _body(client, url + "?q=member&state=approved&page=3")
    assert last.count('id="member-') == 5


@pytest.mark.parametrize(
    "query, found, not_found",
    [
        ("q=member07", ["member07@vision.example"], ["member08@"]),
        ("q=PERSON 12", ["member12@vision.example"], ["member13@"]),
        ("q=milo@vision", ["milo@vision.example"], ["member01@"]),
        ("state=requested", ["asker0@", "pat@vision.example"], ["member01@", "milo@"]),
        ("q=someone", [], ["someone@other.example"]),
        ("role=admin", ["admin@vision.example"], ["member01@", "milo@"]),
    ],
)
def test_the_members_list_finds_by_username_name_email_and_state(
    client, cast, people, query, found, not_found
):
    client.force_login(cast.admin)
    body = _body(client, reverse("lab_admin", args=[cast.lab.slug]) + "?" + query)
    members = body.split('id="members"', 1)[1]
    for text in found:
        assert text in members
    for text in not_found:
        assert text not in members


def test_an_htmx_search_returns_just_the_member_list(client, cast, people):
    client.force_login(cast.admin)
    body = _body(
        client, reverse("lab_admin", args=[cast.lab.slug]) + "?q=member3", HTTP_HX_REQUEST="true"
    )
    assert body.lstrip().startswith('<div id="members">')
    assert "Invite links" not in body
    assert body.count('id="member-') == 10  # member30…member39


def test_the_admin_page_shows_the_oldest_requests_and_says_how_many_wait(client, cast, make_user):
    for i in range(25):
        Membership.objects.create(
            lab=cast.lab,
            user=make_user(f"asker{i:02}@vision.example"),
            state="requested",
            requested_at=timezone.now() - dt.timedelta(minutes=100 - i),
        )
    client.force_login(cast.admin)
    body = _body(client, reverse("lab_admin", args=[cast.lab.slug]))
    requests = body.split("<h2>Requests to join</h2>", 1)[1].split("<h2>Members</h2>", 1)[0]
    assert requests.count('id="membership-') == 10
    assert "The 10 oldest of 26 requests" in requests
    assert "asker00@" in requests and "asker09@" in requests and "asker10@" not in requests
    # The rest are a click away: the member list, filtered to requests.
    assert 'href="?state=requested#members"' in requests
    everyone = _body(client, reverse("lab_admin", args=[cast.lab.slug]) + "?state=requested")
    assert everyone.split('id="members"', 1)[1].count('id="member-') == 25
    assert "1–25 of 26" in everyone


def test_a_member_row_shows_the_person_their_standing_and_since_when(client, cast, people):
    joined = timezone.now() - dt.timedelta(days=40)
    Membership.objects.filter(user__email="member07@vision.example").update(
        role="admin", decided_at=joined, policy_version_accepted=cast.lab.policy_version
    )
    asker = Membership.objects.get(user__email="asker1@vision.example")
    client.force_login(cast.admin)
    body = _body(client, reverse("lab_admin", args=[cast.lab.slug]) + "?q=member07")
    row = body.split('id="members"', 1)[1].split("</tr>", 2)[1]
    member = Membership.objects.get(user__email="member07@vision.example")
    grant_url = reverse("member_grant", args=[cast.lab.slug, member.pk])
    assert f'<a href="{grant_url}">member07@vision.example</a>' in row
    assert '<span class="help">Person 07</span>' in row
    assert "<code>member07</code>" in row
    assert "<td>Lab admin</td>" in row
    assert '<span class="badge approved">Approved</span>' in row
    assert '<span class="badge ok">accepted</span>' in row
    assert f"<td>{joined.day} {joined:%b %Y}</td>" in row
    body = _body(client, reverse("lab_admin", args=[cast.lab.slug]) + "?q=asker1")
    row = body.split('id="members"', 1)[1].split("</tr>", 2)[1]
    asked = timezone.localtime(asker.requested_at)
    assert "<code>" not in row  # no unix username yet
    assert "<td>Member</td>" in row and '<span class="badge requested">Requested</span>' in row
    assert "not the current version" in row
    assert f"<td>{asked.day} {asked:%b %Y}</td>" in row


@pytest.fixture
def fleet_of_vms(cast):
    for i in range(60):
        vm = TpuVm.objects.create(
            lab=cast.lab,
            name=f"tpu{i:02}",
            zone="us-central1-f" if i % 2 else "europe-west4-a",
            accelerator_type="v4-8" if i % 3 else "v5litepod-8",
            state="READY" if i % 5 else "PREEMPTED",
            source="manual",
        )
        Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10")


def test_the_vm_list_pages_and_filters_by_name_zone_state_and_type(client, cast, fleet_of_vms):
    client.force_login(cast.admin)
    url = reverse("vm_list", args=[cast.lab.slug])
    first = _body(client, url)
    assert first.count("/vms/") - first.count("/vms/import") >= 50
    assert "1–50 of 60" in first and "?page=2" in first
    body = _body(client, url + "?zone=europe-west4-a&state=PREEMPTED&accelerator=v5litepod-8")
    # Even, a multiple of 5 and of 3: tpu00, tpu30.
    names = sorted(n for n in (f"tpu{i:02}" for i in range(60)) if f">{n}</a>" in body)
    assert names == ["tpu00", "tpu30"]
    assert ">tpu07</a>" not in _body(client, url + "?name=tpu1")
    assert ">tpu17</a>" in _body(client, url + "?name=TPU1")


def test_a_vm_list_row_shows_the_vm_its_workers_people_and_state(client, cast, make_user):
    seen = TpuVm.objects.create(
        lab=cast.lab,
        name="tpu1",
        zone="us-central1-f",
        accelerator_type="v4-16",
        state="READY",
        health="UNHEALTHY_MAINTENANCE",
        source="imported",
        last_seen_at=timezone.now() - dt.timedelta(minutes=3),
    )
    for index in range(2):
        Worker.objects.create(vm=seen, index=index, external_ip=f"192.0.2.{index + 1}")
    for i, state in enumerate(["active", "pending", "revoked"]):
        Grant.objects.create(user=make_user(f"p{i}@vision.example"), vm=seen, state=state)
    gone = TpuVm.objects.create(
        lab=cast.lab,
        name="tpu2",
        zone="us-central1-f",
        source="manual",
        state="PREEMPTED",
        missing_since=timezone.now(),
    )
    client.force_login(cast.admin)
    body = _body(client, reverse("vm_list", args=[cast.lab.slug]))
    rows = {
        name: body.split(f">{name}</a>", 1)[1].split("</tr>", 1)[0] for name in ("tpu1", "tpu2")
    }
    assert f'<a href="{reverse("vm_detail", args=[cast.lab.slug, seen.pk])}">tpu1</a>' in body
    assert f'<a href="{reverse("vm_detail", args=[cast.lab.slug, gone.pk])}">tpu2</a>' in body
    assert "<td>v4-16</td><td>2</td><td>2</td>" in rows["tpu1"]  # revoked is not counted
    assert '<span class="badge ok">Ready</span>' in rows["tpu1"]
    assert "<td>Under maintenance</td>" in rows["tpu1"]
    assert "<td>3\xa0minutes ago</td>" in rows["tpu1"]
    assert '<span class="badge">manual</span>' in rows["tpu2"]
    assert "<td>?</td><td>0</td><td>0</td>" in rows["tpu2"]
    assert '<span class="badge failed">gone from the API</span>' in rows["tpu2"]
    assert "<td>Unknown</td>" in rows["tpu2"] and "<td>never</td>" in rows["tpu2"]


def test_a_vm_list_page_link_keeps_the_filters(client, cast, fleet_of_vms):
    client.force_login(cast.admin)
    url = reverse("vm_list", args=[cast.lab.slug])
    body = _body(client, url + "?name=tpu&zone=us-central1-f")
    assert "1–30 of 30" not in body  # one page: no pager
    body = _body(client, url + "?name=tpu&state=READY")
    assert "1–48" not in body
    body = _body(client, url + "?name=tpu")
    assert "?name=tpu&amp;page=2" in body
    assert _body(client, url + "?name=tpu&page=2").count(">tpu") == 10


def test_an_unknown_filter_value_is_ignored_rather_than_an_error(client, cast, fleet_of_vms):
    client.force_login(cast.admin)
    body = _body(client, reverse("vm_list", args=[cast.lab.slug]) + "?zone=mars-1&page=zzz")
    assert "1–50 of 60" in body


@pytest.fixture
def busy_vm(cast, make_user):
    """tpu5 with 60 people who have had access for a week, and one being added now."""
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Worker.objects.create(vm=vm, index=0, external_ip="192.0.2.10")
    week_ago = timezone.now() - dt.timedelta(days=7)
    for i in range(60):
        user = make_user(f"old{i:02}@vision.example")
        UnixAccount.objects.create(user=user, username=f"old{i:02}", uid=32_000 + i)
        Grant.objects.create(user=user, vm=vm, state="active", changed_at=week_ago)
    UnixAccount.objects.create(user=cast.member, username="milo", uid=33_000)
    vm.new_grant = Grant.objects.create(user=cast.member, vm=vm, state="pending")
    return vm


def test_the_vm_access_page_lists_its_grants_a_page_at_a_time(client, cast, busy_vm):
    client.force_login(cast.admin)
    url = reverse("vm_access", args=[cast.lab.slug, busy_vm.pk])
    first = _body(client, url)
    assert first.count('<tr id="access-') == 25
    assert "?grants=2" in first and "1–25 of 61" in first
    assert _body(client, url + "?grants=3").count('<tr id="access-') == 11


def test_the_polled_progress_carries_only_the_grants_that_change(client, cast, busy_vm):
    client.force_login(cast.admin)
    body = _body(client, reverse("vm_progress", args=[cast.lab.slug, busy_vm.pk]))
    assert f'id="grant-{busy_vm.new_grant.pk}"' in body
    assert body.count('id="grant-') == 1
    assert "old00" not in body
    assert 'hx-trigger="every 1s"' in body  # still polling while milo is being added


def test_the_audit_log_walks_older_and_newer_without_counting(client, cast):
    start = timezone.now() - dt.timedelta(days=1)
    for i in range(120):
        AuditEvent.objects.create(
            lab=cast.lab,
            action=AuditAction.LAB_UPDATED,
            summary=f"event {i:03}",
            # Pairs share a timestamp: the id breaks the tie.
            created_at=start + dt.timedelta(seconds=i // 2),
        )
    audit.record(AuditAction.LAB_UPDATED, lab=cast.other_lab, summary="event of another lab")
    client.force_login(cast.admin)
    url = reverse("lab_audit", args=[cast.lab.slug])

    def summaries(body):
        return [int(s) for s in re.findall(r"event (\d{3})", body)]

    first = _body(client, url)
    assert summaries(first) == list(range(119, 69, -1))
    assert "Newer" not in first
    older = re.search(r'href="\?older=(\d+)"', first).group(1)
    second = _body(client, f"{url}?older={older}")
    assert summaries(second) == list(range(69, 19, -1))
    third_cursor = re.search(r'href="\?older=(\d+)"', second).group(1)
    third = _body(client, f"{url}?older={third_cursor}")
    assert summaries(third) == list(range(19, -1, -1))
    assert "?older=" not in third
    newer = re.search(r'href="\?newer=(\d+)"', third).group(1)
    assert summaries(_body(client, f"{url}?newer={newer}")) == list(range(69, 19, -1))
    assert "another lab" not in first + second + third


@pytest.mark.parametrize("cursor", ["older=abc", "newer=-1", "older=999999"])
def test_a_bad_audit_cursor_shows_the_newest_events(client, cast, cursor):
    audit.record(AuditAction.LAB_UPDATED, lab=cast.lab, summary="the newest")
    client.force_login(cast.admin)
    assert "the newest" in _body(client, reverse("lab_audit", args=[cast.lab.slug]) + "?" + cursor)


def test_another_labs_event_id_is_no_audit_cursor(client, cast):
    theirs = audit.record(AuditAction.LAB_UPDATED, lab=cast.other_lab, summary="theirs")
    audit.record(AuditAction.LAB_UPDATED, lab=cast.lab, summary="ours")
    client.force_login(cast.admin)
    body = _body(client, reverse("lab_audit", args=[cast.lab.slug]) + f"?older={theirs.pk}")
    assert "ours" in body and "theirs" not in body


def test_a_members_lab_page_shows_their_access_and_the_admins_not_the_other_members(
    client, cast, people
):
    vm = TpuVm.objects.create(lab=cast.lab, name="tpu5", zone="us-central1-f", source="manual")
    Grant.objects.create(user=cast.member, vm=vm, state="active", sudo=True)
    client.force_login(cast.member)
    body = _body(client, reverse("lab_detail", args=[cast.lab.slug]))
    assert ">tpu5</a>" in body and "with sudo" in body
    assert "admin@vision.example" in body  # whom to ask
    assert "member01@vision.example" not in body
    assert "Person 01" not in body
    assert "pat@vision.example" not in body
    assert cast.lab.policy_text.splitlines()[0] in body


def test_pages_are_gzipped_for_browsers_that_accept_it(client, cast, people):
    client.force_login(cast.admin)
    response = client.get(reverse("lab_admin", args=[cast.lab.slug]), HTTP_ACCEPT_ENCODING="gzip")
    assert response["Content-Encoding"] == "gzip"
    assert b"member00@vision.example" in gzip.decompress(response.content)

"""The lab's admin page shows each line of the lab's TPU allowance with the chips the
lab holds against it now (its VMs that are up, its open requests; not a preempted VM,
not another lab's) and the days left until the lab's TPU grant ends it."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from tpus.models import LabAllowance, TpuVm, VmRequest

ZONE = "us-central2-b"


def _vm(lab, name, accelerator_type, *, preemptible=False, state="READY"):
    return TpuVm.objects.create(
        lab=lab,
        name=name,
        zone=ZONE,
        source="manual",
        accelerator_type=accelerator_type,
        preemptible=preemptible,
        state=state,
    )


@pytest.fixture
def holdings(cast):
    lab = cast.lab
    for generation, provisioning, chips in (
        ("v4", "spot", 64),
        ("v3", "on-demand", 20),
        ("v2", "preemptible", 8),
    ):
        LabAllowance.objects.create(
            lab=lab, generation=generation, provisioning=provisioning, chips=chips
        )
    _vm(lab, "tpu5", "v4-32", preemptible=True)  # 16 v4 chips
    _vm(lab, "tpu6", "v4-16", preemptible=True, state="PREEMPTED")  # holds nothing now
    _vm(lab, "tpu7", "v3-8")  # 4 v3 chips
    _vm(lab, "tpu8", "v3-8", state="CREATING")  # 4 more, coming up
    _vm(lab, "tpu9", "v3-8", state="STOPPED")  # stopped by the lab: holds nothing
    VmRequest.objects.create(
        lab=lab,
        name="tpu10",
        zone=ZONE,
        accelerator_type="v4-16",
        runtime_version="tpu-ubuntu2204-base",
        provisioning="spot",
        queued=True,
        state="waiting",
    )  # 8 v4 chips asked for
    # Another lab's VMs and allowance are no part of this lab's page.
    LabAllowance.objects.create(
        lab=cast.other_lab, generation="v5p", provisioning="on-demand", chips=96
    )
    _vm(cast.other_lab, "tpu5", "v3-8")
    return lab


def _page(client, user, lab) -> str:
    client.force_login(user)
    page = client.get(reverse("lab_admin", args=[lab.slug]))
    assert page.status_code == 200
    return page.content.decode()


def _row(text: str, generation: str, kind: str) -> str:
    start = text.index(f"<tr><td>{generation}</td><td>{kind}</td>")
    return text[start : text.index("</tr>", start)]


def test_each_allowance_shows_the_chips_held_allowed_and_left(client, cast, holdings):
    text = _page(client, cast.admin, holdings)
    # held (16 up + 8 asked for), allowed, left
    assert "<td>24</td><td>64</td><td>40</td>" in _row(text, "v4", "spot")
    assert "<td>8</td><td>20</td><td>12</td>" in _row(text, "v3", "on-demand")
    assert "<td>0</td><td>8</td><td>8</td>" in _row(text, "v2", "preemptible")
    assert "v5p" not in text


def test_the_numbers_follow_what_the_lab_holds(client, cast, holdings):
    TpuVm.objects.filter(lab=holdings, name="tpu6").update(state="READY")  # back: 8 more
    text = _page(client, cast.admin, holdings)
    assert "<td>32</td><td>64</td><td>32</td>" in _row(text, "v4", "spot")
    VmRequest.objects.filter(lab=holdings, name="tpu10").update(state="cancelled")
    TpuVm.objects.filter(lab=holdings, name="tpu7").update(state="PREEMPTED")
    text = _page(client, cast.admin, holdings)
    assert "<td>24</td><td>64</td><td>40</td>" in _row(text, "v4", "spot")
    assert "<td>4</td><td>20</td><td>16</td>" in _row(text, "v3", "on-demand")


def test_without_an_end_date_the_allowance_does_not_end(client, cast, holdings):
    text = _page(client, cast.admin, holdings)
    assert "no end date" in _row(text, "v4", "spot")


def test_the_days_left_are_counted_to_the_grants_end(client, cast, holdings):
    ends = timezone.localdate() + dt.timedelta(days=12)
    holdings.grant_end_date = ends
    holdings.save()
    row = _row(_page(client, cast.admin, holdings), "v3", "on-demand")
    assert f"in 12 days, {ends:%-d %B %Y}" in row
    assert "ended" not in row


def test_the_last_day_reads_today_and_a_past_end_reads_ended(client, cast, holdings):
    holdings.grant_end_date = timezone.localdate()
    holdings.save()
    assert '<span class="badge pending">today</span>' in _row(
        _page(client, cast.admin, holdings), "v4", "spot"
    )
    ended = timezone.localdate() - dt.timedelta(days=3)
    holdings.grant_end_date = ended
    holdings.save()
    row = _row(_page(client, cast.admin, holdings), "v4", "spot")
    assert f'<span class="badge failed">ended</span> on {ended:%-d %B %Y}' in row
    assert "in -3 days" not in row


def test_a_lab_without_an_allowance_says_so(client, cast):
    text = _page(client, cast.admin, cast.lab)
    assert "The lab has no allowance yet" in text


def test_members_and_other_labs_admins_do_not_see_it(client, cast, holdings):
    client.force_login(cast.member)
    assert client.get(reverse("lab_admin", args=[holdings.slug])).status_code == 403
    members_page = client.get(reverse("lab_detail", args=[holdings.slug])).content.decode()
    assert "Held now" not in members_page
    client.force_login(cast.outsider)
    assert client.get(reverse("lab_admin", args=[holdings.slug])).status_code == 404
    text = _page(client, cast.outsider, cast.other_lab)
    assert "<tr><td>v5p</td><td>on-demand</td><td>0</td><td>96</td><td>96</td>" in text
    assert "<td>v4</td>" not in text

"""The usage page's charts in a real browser at a phone's width (375 px) and a
desktop's: nothing scrolls the page sideways, the drawings fit their cards, their text
stays readable, and axe-core finds nothing serious, with the tables under the charts
closed and open."""

from __future__ import annotations

import datetime as dt

import pytest

from accounts.models import UnixAccount
from tests.e2e import ARTIFACTS
from tests.test_journey_a11y import BLOCKING, _check_pages, _sideways
from tpus.models import Grant, VmDutyDay
from tpus.tests.jobs_support import make_job, make_vm
from tpus.tests.test_jobs_usage import at

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PASSWORD = "a long passphrase 42"
PERIOD = "?from=2026-01-01&to=2026-01-31"

# Each chart's drawing: its box, the window's width, and the height of its text.
_DRAWINGS = """() => ({
  width: document.documentElement.clientWidth,
  drawings: [...document.querySelectorAll('svg.chart')].map(svg => {
    const box = svg.getBoundingClientRect();
    const text = svg.querySelector('text');
    return {left: box.left, right: box.right, text: text ? text.getBoundingClientRect().height : 0,
            name: svg.getAttribute('aria-labelledby')};
  }),
})"""


@pytest.fixture
def busy_lab(make_lab, make_user, add_member):
    """A lab with eight people's jobs on a pod with a long name and three single
    hosts over January 2026, waits of minutes to hours, a running job, and the chips'
    duty cycle read on some days."""
    lab = make_lab("Vision Lab", slug="vision")
    boss = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, boss, role="admin")
    vms = [make_vm(lab, "tpu5-very-long-pod-name-for-layout", workers=4)]
    vms += [make_vm(lab, f"tpu{n}") for n in range(3)]
    for n in range(8):
        person = make_user(f"person.with-a-long-name-{n}@university.example", password=PASSWORD)
        add_member(lab, person)
        UnixAccount.objects.create(user=person, username=f"person{n}", uid=31_000 + n)
        for vm in vms:
            Grant.objects.create(user=person, vm=vm, state="active")
        for day in range(1 + n, 31, 3):
            vm = vms[(day + n) % len(vms)]
            make_job(vm, person, "succeeded", queued_at=at(day, n), started_at=at(day, n + 1, n),
                     ended_at=at(day, n + 2 + day % 5))  # fmt: skip
    make_job(vms[0], person, "running", queued_at=at(31, 10), started_at=at(31, 12))
    for n, vm in enumerate(vms):
        VmDutyDay.objects.bulk_create(
            VmDutyDay(vm=vm, day=dt.date(2026, 1, day), observed=3600.0,
                      duty=36.0 * ((day * 7 + n * 13) % 100))
            for day in range(1 + n, 32, 2)
        )  # fmt: skip
    return lab


def _sign_in(page, email: str) -> None:
    page.goto("/accounts/login/")
    page.fill("input[name=login]", email)
    page.fill("input[name=password]", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)


def test_the_usage_charts_fit_a_phone_and_pass_axe_with_their_tables_closed_and_open(
    page, live_server, busy_lab
):
    from axe_playwright_python.sync_playwright import Axe

    url = f"/labs/{busy_lab.slug}/usage/{PERIOD}"
    _sign_in(page, "boss@vision.example")
    problems = _check_pages(page, "admin-charts", {"usage": url})

    page.set_viewport_size({"width": 375, "height": 800})
    page.goto(url)
    found = page.evaluate(_DRAWINGS)
    assert len(found["drawings"]) == 3, found
    for drawing in found["drawings"]:
        assert 0 <= drawing["left"] and drawing["right"] <= found["width"], found
        assert drawing["text"] >= 9, found  # px: the axis labels scale with the drawing
    folder = ARTIFACTS / "a11y"
    folder.mkdir(parents=True, exist_ok=True)
    for chart in ("chart-people", "chart-held", "chart-waits"):
        page.locator(f"#{chart}").screenshot(path=folder / f"admin-{chart}-375.png")
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    page.wait_for_timeout(200)
    assert page.locator("#chart-people-table").is_visible()
    # The table of time held is wider than a phone: its card scrolls, from the keyboard too.
    assert page.locator("#chart-held").get_attribute("tabindex") == "0"
    page.screenshot(path=folder / "admin-charts-tables-open-375.png", full_page=True)
    problems += [f"tables open at 375 px: {p}" for p in _sideways(page)]
    for violation in Axe().run(page).response["violations"]:
        if violation["impact"] in BLOCKING:
            targets = [", ".join(node["target"]) for node in violation["nodes"][:5]]
            problems.append(f"tables open: axe {violation['id']}: {violation['help']} at {targets}")
    assert not problems, "\n".join(problems)

"""The main pages in a real browser, at a phone's width (375 px) and a desktop's
(1280 px), as a lab admin, as a member and signed out: nothing scrolls sideways on a
phone (long fingerprints, commands and addresses wrap or scroll inside their own
box), and axe-core finds nothing "serious" or "critical". Every page is saved as a
screenshot under ``test-artifacts/a11y/`` (``PORTAL_TEST_ARTIFACTS`` moves it) for a
person to look at."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from accounts.keys import add_key
from accounts.models import UnixAccount
from accounts.tests.keydata import ECDSA_521, ED25519, RSA_2048
from tests.e2e import ARTIFACTS, WIDTHS
from tpus.models import DataDisk, DiskAttachment, Grant, IpChange, TpuVm, Worker, WorkerSync
from tpus.services.labs import create_invite

pytestmark = [pytest.mark.slow, pytest.mark.browser]

PASSWORD = "a long passphrase 42"  # noqa: S105 (a test account)
# axe-core's impact levels that fail the test; "moderate" and "minor" are reported
# in the failure message of a serious one only.
BLOCKING = {"serious", "critical"}
# A worker's error as long as the ones hosts really print, with a path that has no
# place to break.
LONG_ERROR = (
    "ssh: connect to host 10.213.0.14 port 22: Connection timed out while running "
    "/opt/tpu-portal/reconcile.sh --state-file=/var/lib/tpu-portal/state/"
    "reconcile-0123456789abcdef0123456789abcdef.json"
)


@pytest.fixture
def scene(make_lab, make_user, add_member):
    """A lab as it looks in use: a pod with four pinned workers, a member with access,
    a grant that failed with a long error, a request to join, an invite, a disk."""
    lab = make_lab(
        "Vision Lab",
        slug="vision",
        zones=["us-central1-f", "europe-west4-a"],
        policy_text="Research use only. No gcloud on the VMs.\nBack up your own data.",
    )
    admin = make_user("boss@vision.example", password=PASSWORD)
    add_member(lab, admin, role="admin")
    milo = make_user("milo.sandoval-kowalczyk@university.example", password=PASSWORD)
    add_member(lab, milo)
    UnixAccount.objects.create(user=milo, username="milo", uid=30_001)
    add_key(milo, RSA_2048, "milo's laptop")
    add_key(milo, ECDSA_521, "milo's desktop")
    ada = make_user("ada@vision.example", password=PASSWORD)
    add_member(lab, ada)
    UnixAccount.objects.create(user=ada, username="ada", uid=30_002)
    add_member(lab, make_user("pat@vision.example"), state="requested")
    create_invite(admin, lab)

    vm = TpuVm.objects.create(
        lab=lab,
        name="tpu5-very-long-pod-name-for-layout",
        zone="us-central1-f",
        accelerator_type="v4-32",
        runtime_version="tpu-ubuntu2204-base",
        state="READY",
        source="imported",
        desired_version=3,
    )
    for index in range(4):
        worker = Worker.objects.create(
            vm=vm,
            index=index,
            internal_ip=f"10.128.0.{20 + index}",
            external_ip=f"203.0.113.{20 + index}",
            host_keys=[ED25519.rsplit(" ", 1)[0], RSA_2048.rsplit(" ", 1)[0]],
        )
        WorkerSync.objects.create(
            worker=worker,
            applied_version=3 if index else 2,
            last_attempt_at=timezone.now(),
            last_success_at=timezone.now() - dt.timedelta(minutes=index),
            last_error="" if index else LONG_ERROR,
            last_error_retryable=not index,
        )
    Grant.objects.create(user=milo, vm=vm, state="active", version=2, activated_at=timezone.now())
    Grant.objects.create(user=ada, vm=vm, state="failed", version=3, error=LONG_ERROR)
    IpChange.objects.create(
        worker=vm.workers.get(index=1), old_ip="203.0.113.99", new_ip="203.0.113.21"
    )
    disk = DataDisk.objects.create(lab=lab, name="imagenet-2012-train", zone="us-central1-f")
    DiskAttachment.objects.create(disk=disk, vm=vm)
    return {"lab": lab, "vm": vm, "admin": admin, "milo": milo}


def _sign_in(page, email: str) -> None:
    page.goto("/accounts/login/")
    page.fill("input[name=login]", email)
    page.fill("input[name=password]", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_url(lambda url: "/accounts/login/" not in url)


def _check_pages(page, who: str, urls: dict[str, str]) -> list[str]:
    """Visit each page at each width; the problems found, one line each."""
    from axe_playwright_python.sync_playwright import Axe

    axe = Axe()
    folder = ARTIFACTS / "a11y"
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    for name, url in urls.items():
        for label, width in WIDTHS.items():
            page.set_viewport_size({"width": width, "height": 800})
            response = page.goto(url)
            assert response is not None and response.status == 200, (url, response)
            page.wait_for_load_state("load")
            page.screenshot(path=folder / f"{who}-{name}-{width}.png", full_page=True)
            where = f"{who} {name} at {width} px ({url})"
            if label == "phone":
                problems += [f"{where}: {p}" for p in _sideways(page)]
            results = axe.run(page)
            for violation in results.response["violations"]:
                if violation["impact"] in BLOCKING:
                    targets = [", ".join(node["target"]) for node in violation["nodes"][:5]]
                    problems.append(
                        f"{where}: axe {violation['id']} ({violation['impact']}): "
                        f"{violation['help']} at {targets}"
                    )
    return problems


# Whether the page is wider than the window, and which elements stick out past its
# right edge (the deepest ones, which are the culprits).
_SIDEWAYS = """() => {
  const root = document.documentElement;
  const width = root.clientWidth;
  if (root.scrollWidth <= width + 1) return [];
  const out = [];
  for (const el of document.body.querySelectorAll('*')) {
    const box = el.getBoundingClientRect();
    if (box.right > width + 1 && box.width > 0) {
      const inner = [...el.children].some(c => c.getBoundingClientRect().right > width + 1);
      const cls = typeof el.className === 'string' && el.className.trim()
        ? '.' + el.className.trim().split(/\\s+/).join('.') : '';
      if (!inner) out.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') + cls +
        ' right=' + Math.round(box.right) + ' text=' + (el.textContent || '').trim().slice(0, 40));
    }
  }
  return ['scrollWidth ' + root.scrollWidth + ' > clientWidth ' + width, ...out.slice(0, 8)];
}"""


def _sideways(page) -> list[str]:
    return page.evaluate(_SIDEWAYS)


def test_a_lab_admins_pages_fit_a_phone_and_pass_axe(page, live_server, scene):
    lab, vm = scene["lab"], scene["vm"]
    _sign_in(page, "boss@vision.example")
    problems = _check_pages(
        page,
        "admin",
        {
            "dashboard": "/",
            "lab": f"/labs/{lab.slug}/",
            "lab-admin": f"/labs/{lab.slug}/admin/",
            "vm-list": f"/labs/{lab.slug}/vms/",
            "vm": f"/labs/{lab.slug}/vms/{vm.pk}/",
            "vm-access": f"/labs/{lab.slug}/vms/{vm.pk}/access/",
            "worker-keys": f"/labs/{lab.slug}/vms/{vm.pk}/workers/0/keys/",
            "ssh": "/ssh/",
            "keys": "/account/keys/",
            "two-factor": "/accounts/2fa/",
        },
    )
    assert not problems, "\n".join(problems)


def test_a_members_pages_fit_a_phone_and_pass_axe(page, live_server, scene):
    lab, vm = scene["lab"], scene["vm"]
    _sign_in(page, scene["milo"].email)
    problems = _check_pages(
        page,
        "member",
        {
            "dashboard": "/",
            "lab": f"/labs/{lab.slug}/",
            "vm": f"/labs/{lab.slug}/vms/{vm.pk}/",
            "ssh": "/ssh/",
            "keys": "/account/keys/",
            "two-factor": "/accounts/2fa/",
        },
    )
    assert not problems, "\n".join(problems)


def test_the_sign_in_and_sign_up_pages_fit_a_phone_and_pass_axe(page, live_server, db):
    problems = _check_pages(
        page,
        "visitor",
        {"sign-in": "/accounts/login/", "sign-up": "/accounts/signup/"},
    )
    assert not problems, "\n".join(problems)


# Each word of the first <pre> that holds "ssh-keygen", and on how many lines it lies.
_WORD_LINES = """() => {
  const pre = [...document.querySelectorAll('pre')].find(p => p.textContent.includes('ssh-keygen'));
  const text = pre.firstChild;
  const out = [];
  const re = /\\S+/g;
  let m;
  while ((m = re.exec(text.textContent)) !== null) {
    const range = document.createRange();
    range.setStart(text, m.index);
    range.setEnd(text, m.index + m[0].length);
    const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
    out.push([m[0], tops.size]);
  }
  return out;
}"""


def test_on_a_phone_the_ssh_keygen_example_breaks_only_between_words(page, live_server, scene):
    _sign_in(page, "boss@vision.example")  # no keys yet: the dashboard shows how to make one
    page.set_viewport_size({"width": 320, "height": 800})
    page.goto("/")
    words = page.evaluate(_WORD_LINES)
    assert [w for w, _ in words][:5] == ["ssh-keygen", "-t", "ed25519", "-C", '"you@laptop"']
    assert all(lines == 1 for _, lines in words), words
    # It did wrap (it is wider than the box), at a space.
    height = page.evaluate(
        "() => [...document.querySelectorAll('pre')].find(p => p.textContent.includes("
        "'ssh-keygen')).getClientRects()[0].height"
    )
    assert height > 70


_LOOK = """(text) => {
  const b = [...document.querySelectorAll('button')].find(b => b.textContent.trim() === text);
  const s = getComputedStyle(b);
  return {background: s.backgroundColor, color: s.color, border: s.borderTopWidth + ' ' +
    s.borderTopStyle + ' ' + s.borderTopColor};
}"""


def test_destructive_buttons_look_unlike_the_primary_one(page, live_server, scene):
    _sign_in(page, "boss@vision.example")
    page.goto(f"/labs/{scene['lab'].slug}/admin/")
    primary = page.evaluate(_LOOK, "Create invite")
    revoke = page.evaluate(_LOOK, "Revoke")
    reject = page.evaluate(_LOOK, "Reject")
    assert primary["background"] == "rgb(31, 95, 214)" and primary["border"].startswith("0px")
    for destructive in (revoke, reject):
        # Outlined in red on white: another shape as well as another colour.
        assert destructive["background"] == "rgb(255, 255, 255)"
        assert destructive["border"] == "1px solid rgb(179, 38, 30)"
        assert destructive["color"] == "rgb(179, 38, 30)"


# Where each named element is, and the window's width.
_BOXES = """(selectors) => ({
  width: document.documentElement.clientWidth,
  boxes: Object.fromEntries(selectors.map(s => {
    const el = document.querySelector(s);
    const r = el ? el.getBoundingClientRect() : null;
    return [s, r && {left: r.left, right: r.right, top: r.top, bottom: r.bottom}];
  })),
})"""


def test_on_a_phone_approve_and_reject_are_on_screen_and_dates_sit_with_their_labels(
    page, live_server, scene
):
    lab = scene["lab"]
    _sign_in(page, "boss@vision.example")
    page.set_viewport_size({"width": 375, "height": 800})
    page.goto(f"/labs/{lab.slug}/admin/")
    request = "#request-list tbody tr[id^=membership-]"
    found = page.evaluate(
        _BOXES, [f"{request} button:not(.danger)", f"{request} button.danger", request]
    )
    approve, reject, row = found["boxes"].values()
    for button in (approve, reject):
        assert button and 0 <= button["left"] and button["right"] <= found["width"], found
    assert row["right"] <= found["width"] + 1, found

    milo = lab.memberships.get(user=scene["milo"])
    for url in (f"/labs/{lab.slug}/memberships/{milo.pk}/grant/",
                f"/labs/{lab.slug}/vms/{scene['vm'].pk}/access/"):  # fmt: skip
        page.goto(url)
        found = page.evaluate(_BOXES, ["label[for=id_expires_on]", "input#id_expires_on"])
        label, field = found["boxes"].values()
        # On one line: the field's box spans the label's middle, to its right.
        middle = (label["top"] + label["bottom"]) / 2
        assert field["top"] <= middle <= field["bottom"], (url, found)
        assert label["right"] <= field["left"] and field["right"] <= found["width"], (url, found)


def test_the_authenticator_page_an_admin_is_sent_to_says_why_and_passes_axe(
    page, live_server, scene, settings
):
    settings.PORTAL_REQUIRE_ADMIN_MFA = True
    _sign_in(page, "boss@vision.example")
    assert page.url.endswith("/accounts/2fa/totp/activate/"), page.url
    assert "authenticator app" in page.locator("#why-totp").inner_text()
    assert page.locator("form[action$='/totp/activate/'] [name=csrfmiddlewaretoken]").count() == 1
    problems = _check_pages(page, "admin", {"two-factor-activate": "/accounts/2fa/totp/activate/"})
    assert not problems, "\n".join(problems)

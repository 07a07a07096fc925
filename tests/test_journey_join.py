"""Journey 1 in a real browser: a collaborator signs up, verifies the emailed link,
asks to join a lab and accepts its policy; the lab's admin is emailed by a real
Celery worker through a real SMTP server."""

from __future__ import annotations

import pytest

from tpus.models import Lab, Membership

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_a_collaborator_signs_up_verifies_and_asks_to_join(
    page, live_server, smtp_sink, celery_worker_process, make_user, add_member
):
    lab = Lab.objects.create(
        name="Vision Lab", slug="vision", gcp_project_id="vision-lab-1", zones=["us-central1-f"]
    )
    add_member(lab, make_user("boss@vision.example"), role="admin")

    page.goto("/accounts/signup/")
    page.fill("input[name=email]", "milo@uni.example")
    page.fill("input[name=password1]", "a long passphrase 42")
    page.fill("input[name=password2]", "a long passphrase 42")
    page.click("form button[type=submit]")
    page.wait_for_selector("text=Verify Your Email Address")

    message = smtp_sink.wait_for("milo@uni.example", "Confirm")
    page.goto(smtp_sink.link(message, r"http://[^\s]+/accounts/confirm-email/\S+"))
    page.click("form button[type=submit]")
    page.wait_for_selector("text=Hello, milo")

    page.click("text=Labs")
    page.click("text=Ask to join")
    page.fill("textarea[name=purpose]", "Training vision transformers on ImageNet.")
    page.check("input[name=accept_policy]")
    page.click("text=Send request")
    page.wait_for_selector("text=Request pending")

    notice = smtp_sink.wait_for("boss@vision.example", "asks to join Vision Lab")
    assert "Training vision transformers on ImageNet." in smtp_sink.body(notice)
    membership = Membership.objects.get(user__email="milo@uni.example", lab=lab)
    assert membership.state == "requested"
    assert membership.policy_version_accepted == lab.policy_version

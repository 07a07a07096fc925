"""The lab's policy on idle chips, driven with chip samples written directly: the pass
reads what is stored and asks no worker anything (the remote door for an outside
process is patched at its one choke point). Each step is taken once, a holding that is
busy again starts over, exempt people and VMs are left alone, and the settings are a
lab admin's, validated and audited, on the page and in the API."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import mail
from django.urls import reverse

from accounts.services import create_token
from portal.models import OutboxMessage
from tpus.models import AuditEvent, ChipSample, IdleHolding, Job, Membership, TpuVm
from tpus.remote import ScriptResult
from tpus.services import idle_holders
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job

scene = jobs_support.scene
GIB = 1024**3
T0 = dt.datetime(2026, 3, 2, 14, 2, tzinfo=dt.UTC)


def minutes(n: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=n)


def policy(lab, **fields) -> None:
    fields = {"idle_policy_enabled": True, **fields}
    for name, value in fields.items():
        setattr(lab, name, value)
    lab.save()


def sample(vm, at, duty, *, chips=(0, 1, 2, 3), worker=0, used=10 * GIB) -> None:
    """One sample of each chip at ``at`` (and the VM's last answer), as the poll keeps."""
    ChipSample.objects.bulk_create(
        ChipSample(vm=vm, worker=worker, chip=c, at=at, hbm_used=used, hbm_total=32 * GIB,
                   duty=duty)
        for c in chips
    )  # fmt: skip
    TpuVm.objects.filter(pk=vm.pk).update(
        chip_metrics=[
            {"worker": worker, "none": "",
             "chips": [{"chip": c, "used": used, "total": 32 * GIB, "duty": duty} for c in chips]}
        ],
        chip_metrics_at=at,
    )  # fmt: skip


def run(at):
    return idle_holders.run_pass(now=at)


def mails(kind: str) -> list[OutboxMessage]:
    return list(OutboxMessage.objects.filter(kind=kind).order_by("pk"))


@pytest.fixture
def idle_job(scene, settings):
    """milo's job, running since before T0, its chips at 0 % from T0 on."""
    settings.PORTAL_CHIP_METRICS_KEEP_MINUTES = 600
    policy(scene.lab)
    job = make_job(scene.vm, scene.milo, "running", started_at=T0 - dt.timedelta(hours=1))
    return job


def idle_until(vm, last: float, *, first: float = 0, every: float = 10) -> None:
    """A sample at 0 % duty every ``every`` minutes from ``first`` to ``last``."""
    n = first
    while n <= last:
        sample(vm, minutes(n), 0.0)
        n += every


def test_a_job_idle_for_the_minutes_to_warn_gets_its_person_one_email(scene, idle_job):
    idle_until(scene.vm, 20)
    assert run(minutes(20)).warned == []
    assert not mails("idle_warned")

    idle_until(scene.vm, 30)
    report = run(minutes(30))
    [row] = IdleHolding.objects.all()
    assert report.warned == [row.pk]
    assert row.job == idle_job and row.idle_since == T0 and row.warned_at == minutes(30)
    assert row.hbm_used == 40 * GIB and row.chips == [[0, 0], [0, 1], [0, 2], [0, 3]]
    [message] = mails("idle_warned")
    assert message.to == scene.milo.email
    assert f"Job {idle_job.pk} on tpu5" in message.subject
    assert "40.0 GiB" in message.body and "worker 0 chip 3" in message.body
    assert AuditEvent.objects.filter(action="idle.warned", target_user=scene.milo).count() == 1

    # Later passes send nothing again.
    sample(scene.vm, minutes(40), 0.0)
    run(minutes(40))
    run(minutes(45))
    assert len(mails("idle_warned")) == 1


def test_the_admins_are_told_the_minutes_to_admins_after_the_warning_and_release_off_ends_nothing(
    scene, idle_job, queued_tasks
):
    idle_until(scene.vm, 30)
    run(minutes(30))
    idle_until(scene.vm, 50, first=40)
    assert run(minutes(59)).admins_told == []
    idle_until(scene.vm, 60, first=60)
    report = run(minutes(60))
    [row] = IdleHolding.objects.all()
    assert report.admins_told == [row.pk] and report.released == []
    [message] = mails("idle_admins")
    assert message.to == scene.admin.email
    assert "does not release" in message.body
    idle_job.refresh_from_db()
    assert idle_job.state == "running" and not idle_job.cancel_requested_at
    run(minutes(70))
    assert len(mails("idle_admins")) == 1


def test_with_release_on_the_idle_job_is_cancelled_through_the_cancel_service(
    scene, idle_job, queued_tasks, django_capture_on_commit_callbacks
):
    policy(scene.lab, idle_release=True)
    idle_until(scene.vm, 30)
    run(minutes(30))
    idle_until(scene.vm, 60, first=40)
    with django_capture_on_commit_callbacks(execute=True):
        report = run(minutes(60))
    [row] = IdleHolding.objects.all()
    assert report.released == [row.pk]
    idle_job.refresh_from_db()
    # As a cancel does: the job is cancelling, and the VM's pass is asked to stop it.
    assert idle_job.state == "cancelling" and idle_job.cancel_requested_at
    assert "policy on idle chips" in idle_job.reason
    assert queued_tasks.take("tpus.tasks.advance_jobs") == [((scene.vm.pk,), None)]
    assert AuditEvent.objects.filter(action="job.cancel_requested").count() == 1
    assert AuditEvent.objects.filter(action="idle.released").count() == 1
    [told] = [m for m in mail.outbox if "was ended" in m.subject]
    assert told.to == [scene.milo.email] and f"cancelled job {idle_job.pk}" in told.body
    assert IdleHolding.objects.get().released_at == minutes(60)

    # The page says what happened.
    Job.objects.filter(pk=idle_job.pk).update(state="cancelled", ended_at=minutes(61))
    run(minutes(62))
    from django.test import Client

    client = Client()
    client.force_login(scene.milo)
    page = client.get(reverse("vm_jobs", args=["vision", scene.vm.pk])).content.decode()
    assert "idle since 14:02, told 14:32, admins told 15:02; released at 15:02 by the lab" in page


def test_a_holding_busy_again_starts_over(scene, idle_job):
    idle_until(scene.vm, 30)
    run(minutes(30))
    sample(scene.vm, minutes(40), 55.0)
    report = run(minutes(40))
    [row] = IdleHolding.objects.all()
    assert report.reset == [row.pk]
    assert (row.idle_since, row.warned_at, row.admins_told_at) == (None, None, None)
    assert AuditEvent.objects.filter(action="idle.busy_again").count() == 1

    # Idle again: a new spell, counted from the first idle sample after the busy one.
    for n in (50, 60, 70, 80):
        sample(scene.vm, minutes(n), 0.0)
    run(minutes(70))
    assert len(mails("idle_warned")) == 1  # only the first spell's
    run(minutes(80))
    row.refresh_from_db()
    assert row.idle_since == minutes(50) and row.warned_at == minutes(80)
    assert len(mails("idle_warned")) == 2
    assert not mails("idle_admins")


def test_a_busy_spell_between_two_passes_starts_the_holding_over_too(scene, idle_job):
    idle_until(scene.vm, 30)
    run(minutes(30))
    sample(scene.vm, minutes(35), 70.0)
    idle_until(scene.vm, 60, first=40)
    run(minutes(60))  # the pass did not run while the chips were busy
    row = IdleHolding.objects.get()
    assert row.idle_since == minutes(40) and row.warned_at is None
    assert not mails("idle_admins") and len(mails("idle_warned")) == 1
    run(minutes(70))
    row.refresh_from_db()
    assert row.warned_at == minutes(70) and len(mails("idle_warned")) == 2


def test_one_busy_chip_keeps_the_job_busy(scene, idle_job):
    for n in (0, 10, 20, 30):
        sample(scene.vm, minutes(n), 0.0, chips=(0, 1, 2))
        sample(scene.vm, minutes(n) + dt.timedelta(seconds=1), 40.0, chips=(3,))
    run(minutes(30))
    assert not IdleHolding.objects.exists() and not mails("idle_warned")


def test_an_exempt_person_is_never_warned(scene, idle_job):
    Membership.objects.filter(lab=scene.lab, user=scene.milo).update(idle_exempt=True)
    idle_until(scene.vm, 90)
    for n in (30, 60, 90):
        run(minutes(n))
    assert not mails("idle_warned") and not mails("idle_admins")
    assert not IdleHolding.objects.exists()


def test_an_exempt_vm_is_never_warned(scene, idle_job):
    TpuVm.objects.filter(pk=scene.vm.pk).update(idle_exempt=True)
    idle_until(scene.vm, 90)
    for n in (30, 60, 90):
        run(minutes(n))
    assert not mails("idle_warned") and not IdleHolding.objects.exists()


def test_with_the_policy_off_the_pass_does_nothing(scene, idle_job):
    policy(scene.lab, idle_policy_enabled=False)
    idle_until(scene.vm, 90)
    for n in (30, 60, 90):
        assert run(minutes(n)).looked_at == 0
    assert not IdleHolding.objects.exists() and not OutboxMessage.objects.exists()


def test_another_labs_policy_does_not_reach_this_labs_vms(scene, idle_job, cast):
    policy(scene.lab, idle_policy_enabled=False)
    policy(cast.other_lab, idle_warn_minutes=1, idle_release=True)
    idle_until(scene.vm, 90)
    for n in (30, 60, 90):
        run(minutes(n))
    assert not IdleHolding.objects.exists() and not OutboxMessage.objects.exists()


def test_a_job_that_ended_by_itself_is_forgotten(scene, idle_job):
    idle_until(scene.vm, 30)
    run(minutes(30))
    Job.objects.filter(pk=idle_job.pk).update(state="succeeded", ended_at=minutes(31))
    run(minutes(32))
    assert not IdleHolding.objects.exists()


# --- a process the portal did not start ---------------------------------------------


@pytest.fixture
def outside(scene, settings):
    settings.PORTAL_CHIP_METRICS_KEEP_MINUTES = 600
    settings.PORTAL_IDLE_RELEASE_GRACE_SECONDS = 7
    policy(scene.lab, idle_release=True)
    TpuVm.objects.filter(pk=scene.vm.pk).update(
        outside_holders=[
            {"worker": 0, "device": f"/dev/accel{c}", "pid": "4242", "start": "98765",
             "user": "ann", "command": "python notebook.py"}
            for c in (0, 1)
        ]
    )  # fmt: skip
    return scene


class FakeDoor:
    """The remote door's one call for a script: records what was sent, answers."""

    def __init__(self, answer: str = "stop=term\nalive=0\n") -> None:
        self.calls: list[tuple[str, str, bytes]] = []
        self.answer = answer

    def __call__(self, worker, script, data=b"", **options):
        self.calls.append((worker.address, script, data))
        pairs = [tuple(line.split("=", 1)) for line in self.answer.splitlines()]
        return ScriptResult(worker, script, 0, self.answer, pairs=pairs)


def test_an_idle_process_outside_the_portal_is_warned_then_stopped_on_its_worker(
    outside, monkeypatch, queued_tasks, django_capture_on_commit_callbacks
):
    door = FakeDoor()
    monkeypatch.setattr(idle_holders, "run_script", door)
    vm = outside.vm
    for n in (0, 10, 20, 30):
        sample(vm, minutes(n), 0.0, chips=(0, 1))
        sample(vm, minutes(n) + dt.timedelta(seconds=1), 90.0, chips=(2, 3))  # not ann's
    run(minutes(30))
    [row] = IdleHolding.objects.all()
    assert (row.pid, row.start, row.worker, row.unix_user) == (4242, 98765, 0, "ann")
    assert row.person == outside.ann and row.warned_at == minutes(30)
    [warned] = mails("idle_warned")
    assert warned.to == outside.ann.email and "Process 4242 of ann" in warned.subject
    assert door.calls == []

    for n in (40, 50, 60):
        sample(vm, minutes(n), 0.0, chips=(0, 1))
    with django_capture_on_commit_callbacks(execute=True):
        report = run(minutes(60))
    assert report.released == [row.pk]
    [(address, script, data)] = door.calls
    assert (address, script) == ("192.0.2.10", "holder-stop.sh")
    assert data == (
        b"tpu-portal-holder-stop 1\npid 4242\nstart 98765\nchips /dev/accel*\ngrace 7\nend\n"
    )
    row.refresh_from_db()
    assert row.outcome == "ended with TERM" and row.released_at == minutes(60)
    vm.refresh_from_db()
    assert vm.outside_holders == []  # free for the queue
    assert queued_tasks.take("tpus.tasks.advance_jobs") == [((vm.pk,), None)]
    [told] = mails("idle_released")
    assert told.to == outside.ann.email
    run(minutes(70))
    assert len(door.calls) == 1


def test_a_worker_that_cannot_be_reached_leaves_the_release_for_the_next_pass(outside, monkeypatch):
    from tpus.remote import RemoteError

    def unreachable(worker, script, data=b"", **options):
        raise RemoteError("no route to host", kind=RemoteError.UNREACHABLE, retryable=True)

    monkeypatch.setattr(idle_holders, "run_script", unreachable)
    for n in (0, 10, 20, 30, 40, 50, 60):
        sample(outside.vm, minutes(n), 0.0, chips=(0, 1))
    run(minutes(30))
    run(minutes(60))
    row = IdleHolding.objects.get()
    assert row.admins_told_at == minutes(60) and row.released_at is None
    assert "no route to host" in row.outcome
    assert not mails("idle_released")

    door = FakeDoor("stop=kill\nalive=0\n")
    monkeypatch.setattr(idle_holders, "run_script", door)
    run(minutes(61))
    row.refresh_from_db()
    assert row.released_at == minutes(61) and "KILL" in row.outcome
    assert len(mails("idle_admins")) == 1


def test_a_process_whose_start_time_is_unknown_is_never_signalled(outside, monkeypatch):
    door = FakeDoor()
    monkeypatch.setattr(idle_holders, "run_script", door)
    vm = TpuVm.objects.get(pk=outside.vm.pk)
    vm.outside_holders = [{**h, "start": ""} for h in vm.outside_holders]
    vm.save(update_fields=["outside_holders"])
    for n in (0, 10, 20, 30, 40, 50, 60):
        sample(vm, minutes(n), 0.0, chips=(0, 1))
    run(minutes(30))
    run(minutes(60))
    assert door.calls == []
    row = IdleHolding.objects.get()
    assert row.released_at is None and "start time is unknown" in row.outcome


# --- the settings ---------------------------------------------------------------------


def settings_form(lab, **changes) -> dict:
    data = {
        "name": lab.name, "policy_text": lab.policy_text, "discoverable": "on",
        "job_tasks_max": 4096, "job_memory_max_mb": 0, "job_log_max_mb": 100,
        "max_chips_per_person": 0, "max_waiting_jobs_per_person": 0,
        "fair_share_half_life_days": 7, "token_lifetime_days": 90,
        "idle_threshold_percent": 1, "idle_warn_minutes": 30, "idle_admins_minutes": 30,
    }  # fmt: skip
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


def test_a_lab_admin_sets_the_policy_and_exemptions_on_the_settings_page(client, scene):
    client.force_login(scene.admin)
    url = reverse("lab_settings", args=["vision"])
    page = client.get(url).content.decode()
    assert "act on idle chips" in page.lower() and "milo@vision.example" in page and "tpu5" in page
    milo_membership = Membership.objects.get(lab=scene.lab, user=scene.milo)
    response = client.post(
        url,
        settings_form(
            scene.lab, idle_policy_enabled="on", idle_threshold_percent="2.5",
            idle_warn_minutes=10, idle_admins_minutes=20, idle_release="on",
            idle_exempt_people=[milo_membership.pk], idle_exempt_vms=[scene.vm.pk],
        ),
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[-3000:]
    scene.lab.refresh_from_db()
    assert scene.lab.idle_policy_enabled and scene.lab.idle_release
    assert str(scene.lab.idle_threshold_percent) == "2.5"
    assert (scene.lab.idle_warn_minutes, scene.lab.idle_admins_minutes) == (10, 20)
    assert Membership.objects.get(pk=milo_membership.pk).idle_exempt
    assert TpuVm.objects.get(pk=scene.vm.pk).idle_exempt
    assert AuditEvent.objects.filter(action="idle.exemptions_set", actor=scene.admin).exists()
    updated = AuditEvent.objects.get(action="lab.updated")
    assert "idle_policy_enabled" in updated.data["fields"]


@pytest.mark.parametrize(
    "changes",
    [
        {"idle_threshold_percent": "0"},
        {"idle_threshold_percent": "100.5"},
        {"idle_threshold_percent": "0.05"},
        {"idle_warn_minutes": 0},
        {"idle_admins_minutes": "soon"},
        {"idle_warn_minutes": 10081},
    ],
)
def test_a_bad_policy_is_refused_with_its_field_and_nothing_changes(client, scene, changes):
    client.force_login(scene.admin)
    response = client.post(
        reverse("lab_settings", args=["vision"]),
        settings_form(scene.lab, idle_policy_enabled="on", **changes),
    )
    assert response.status_code == 200
    [field] = changes
    assert field in response.context["form"].errors
    scene.lab.refresh_from_db()
    assert not scene.lab.idle_policy_enabled
    assert not AuditEvent.objects.filter(action="lab.updated").exists()


def test_another_labs_vm_cannot_be_exempted(client, scene, cast):
    other_vm = jobs_support.make_vm(cast.other_lab, "theirs")
    client.force_login(scene.admin)
    response = client.post(
        reverse("lab_settings", args=["vision"]),
        settings_form(scene.lab, idle_exempt_vms=[other_vm.pk]),
    )
    assert response.status_code == 200 and "idle_exempt_vms" in response.context["form"].errors
    assert not TpuVm.objects.filter(idle_exempt=True).exists()


def test_members_and_other_labs_admins_cannot_set_the_policy(client, scene, cast):
    url = reverse("lab_settings", args=["vision"])
    client.force_login(scene.milo)
    assert client.post(url, settings_form(scene.lab, idle_policy_enabled="on")).status_code in (
        403,
        404,
    )
    client.force_login(cast.outsider)
    assert client.post(url, settings_form(scene.lab, idle_policy_enabled="on")).status_code == 404
    scene.lab.refresh_from_db()
    assert not scene.lab.idle_policy_enabled


def test_the_api_lab_settings_carry_the_policy_and_the_exemptions(client, scene, cast):
    token = create_token(scene.admin, "t")[1]
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    url = "/api/v1/labs/vision/settings"
    got = client.get(url, **auth).json()
    assert got["idle_policy_enabled"] is False and got["idle_threshold_percent"] == 1.0
    assert (got["idle_warn_minutes"], got["idle_admins_minutes"]) == (30, 30)
    assert got["idle_exempt_people"] == [] and got["idle_exempt_vms"] == []

    response = client.patch(
        url,
        {"idle_policy_enabled": True, "idle_warn_minutes": 5,
         "idle_exempt_people": ["Milo@vision.example"], "idle_exempt_vms": ["tpu5"]},
        content_type="application/json", **auth,
    )  # fmt: skip
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["idle_policy_enabled"] is True and body["idle_warn_minutes"] == 5
    assert body["idle_exempt_people"] == ["milo@vision.example"]
    assert body["idle_exempt_vms"] == ["tpu5"]

    # A change of something else keeps the exemptions.
    response = client.patch(url, {"idle_release": True}, content_type="application/json", **auth)
    assert response.json()["idle_exempt_vms"] == ["tpu5"]

    for bad in ({"idle_exempt_people": ["eve@other.example"]}, {"idle_exempt_vms": ["nope"]},
                {"idle_threshold_percent": 0}, {"idle_admins_minutes": -1}):  # fmt: skip
        refused = client.patch(url, bad, content_type="application/json", **auth)
        assert refused.status_code == 400, bad
        [field] = bad
        assert field in refused.json()["errors"]
    assert client.get(url, **auth).json()["idle_exempt_people"] == ["milo@vision.example"]

    member = {"HTTP_AUTHORIZATION": f"Bearer {create_token(scene.milo, 't')[1]}"}
    assert client.patch(url, {"idle_release": False}, content_type="application/json",
                        **member).status_code in (403, 404)  # fmt: skip
    outsider = {"HTTP_AUTHORIZATION": f"Bearer {create_token(cast.outsider, 't')[1]}"}
    assert client.patch(url, {"idle_release": False}, content_type="application/json",
                        **outsider).status_code == 404  # fmt: skip


def test_the_pass_is_bounded_and_goes_round_the_vms(scene, settings):
    policy(scene.lab)
    vms = [scene.vm] + [jobs_support.make_vm(scene.lab, f"tpu{n}") for n in (6, 7)]
    for vm in vms:
        make_job(vm, scene.milo, "running")
    assert idle_holders.run_pass(2, now=minutes(1)).looked_at == 2
    left = TpuVm.objects.get(idle_looked_at__isnull=True)
    assert idle_holders.run_pass(2, now=minutes(2)).looked_at == 2
    left.refresh_from_db()
    assert left.idle_looked_at == minutes(2)

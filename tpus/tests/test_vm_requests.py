"""A lab admin asks the portal for a TPU VM, against the emulator: every bad request is
refused before anything is asked of Google, the allowance is kept with its numbers,
a direct create and a queued one (in a stockout, until capacity comes) both end with
the VM in the lab, connected from its creation and pinned; failures and cancels show."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.utils import timezone

from tpus.models import (
    AuditEvent,
    LabAllowance,
    TpuVm,
    VmConnection,
    VmRequest,
    Worker,
    WorkerSync,
)
from tpus.services import allowances, keep_alive, reconcile, vm_request_work, vm_requests
from tpus.services.vm_requests import VmSpec

PROJECT = "vision-project"
ZONE = "us-central2-b"
CALLS = ("CreateNode", "CreateQueuedResource")


@pytest.fixture
def lab(cast, tpu_emulator):
    cast.lab.gcp_project_id = PROJECT
    cast.lab.zones = [ZONE]
    cast.lab.save()
    LabAllowance.objects.create(lab=cast.lab, generation="v4", provisioning="spot", chips=16)
    LabAllowance.objects.create(lab=cast.lab, generation="v4", provisioning="on-demand", chips=8)
    return cast.lab


def spec(**fields) -> VmSpec:
    values = dict(
        name="tpu5",
        zone=ZONE,
        accelerator_type="v4-32",
        runtime_version="tpu-ubuntu2204-base",
        provisioning="spot",
    )
    values.update(fields)
    return VmSpec(**values)


def refusal(cast, lab, tpu_emulator, **fields) -> dict:
    with pytest.raises(ValidationError) as refused:
        vm_requests.request_vm(cast.admin, lab, spec(**fields))
    assert not VmRequest.objects.exists()
    assert not any(tpu_emulator.requests[c] for c in CALLS)
    return refused.value.message_dict


@pytest.mark.parametrize(
    "fields, field, text",
    [
        ({"name": "Tpu_5"}, "name", "lowercase letters"),
        ({"zone": "europe-west4-a"}, "zone", "Choose one of the lab's zones: us-central2-b"),
        ({"accelerator_type": "v4-31"}, "accelerator_type", "offers"),
        ({"runtime_version": "tpu-vm-tf-9"}, "runtime_version", "has no runtime version"),
        ({"provisioning": "reserved"}, "provisioning", "on-demand, spot or preemptible"),
        (
            {"valid_until": timezone.now() + dt.timedelta(days=1)},
            "valid_until",
            "queued request only",
        ),
    ],
)
def test_a_bad_request_is_refused_with_its_field_and_asks_google_for_nothing(
    cast, lab, tpu_emulator, fields, field, text
):
    assert text in " ".join(refusal(cast, lab, tpu_emulator, **fields)[field])


def test_a_request_past_the_allowance_is_refused_with_the_numbers(cast, lab, tpu_emulator):
    errors = refusal(cast, lab, tpu_emulator, provisioning="on-demand")
    assert errors["accelerator_type"] == [
        "A v4-32 is 16 v4 chips; the lab holds 0 on-demand v4 chips of its 8, so 8 are left."
    ]
    errors = refusal(cast, lab, tpu_emulator, provisioning="preemptible")
    assert "no allowance for preemptible v4 chips" in errors["accelerator_type"][0]


def test_an_open_request_counts_against_the_allowance(cast, lab, tpu_emulator):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    with pytest.raises(ValidationError) as refused:
        vm_requests.request_vm(cast.admin, lab, spec(name="tpu6", queued=True))
    assert "holds 16 spot v4 chips of its 16, so 0 are left" in str(refused.value)


def test_after_the_grant_ends_nothing_can_be_made(cast, lab, tpu_emulator):
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    assert "grant ended" in refusal(cast, lab, tpu_emulator)["accelerator_type"][0]


def test_only_the_labs_admins_may_ask(cast, lab, tpu_emulator):
    with pytest.raises(PermissionDenied):
        vm_requests.request_vm(cast.member, lab, spec())
    with pytest.raises(PermissionDenied):
        vm_requests.request_vm(cast.outsider, lab, spec())
    assert not VmRequest.objects.exists()


def test_a_direct_create_puts_the_vm_in_the_lab_connected_and_pinned(cast, lab, tpu_emulator):
    made = vm_requests.request_vm(cast.admin, lab, spec())
    assert made.state == "requested"
    vm_request_work.send(made.pk)

    made.refresh_from_db()
    assert made.state == "ready" and made.vm is not None
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    assert (vm.source, vm.accelerator_type, vm.workers.count()) == ("created", "v4-32", 4)
    assert all(w.is_pinned for w in vm.workers.all())
    assert VmConnection.objects.get(vm=vm).state == "connecting"
    # The lab's key line is in the node's metadata from its creation: no Connect step.
    metadata = tpu_emulator.controls.metadata("tpu5")
    assert metadata["ssh-keys"] == vm_request_work.key_metadata(lab)["ssh-keys"]
    assert tpu_emulator.requests["UpdateNode"] == 0
    actions = list(AuditEvent.objects.filter(lab=lab).values_list("action", flat=True))
    assert "vm.requested" in actions and "vm.created" in actions


def test_a_direct_create_in_a_stockout_fails_and_says_to_queue_it(cast, lab, tpu_emulator):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec())
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "failed" and made.error_code == "RESOURCE_EXHAUSTED"
    assert "Ask again as a queued request" in made.error
    assert not TpuVm.objects.filter(lab=lab).exists()


def test_a_queued_request_waits_in_a_stockout_and_the_vm_arrives_with_capacity(
    cast, lab, tpu_emulator
):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "waiting" and made.waiting_since is not None
    assert made.cloud_id == f"tpu5-{made.pk}"
    vm_request_work.send(made.pk)  # another look: still waiting, nothing asked twice
    assert tpu_emulator.requests["CreateQueuedResource"] == 1
    assert not TpuVm.objects.filter(lab=lab).exists()

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "ready"
    assert TpuVm.objects.get(lab=lab, name="tpu5").source == "created"


def test_a_request_google_fails_shows_why(cast, lab, tpu_emulator):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    tpu_emulator.controls.fail_request(
        made.cloud_id, "RESOURCE_EXHAUSTED", "Quota 'TPUV4sPodPerProjectPerZone' exceeded."
    )
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "failed"
    assert made.error.startswith("tpu5 was not made: Google Cloud ran out of capacity or quota")
    assert "TPUV4sPodPerProjectPerZone" in made.error
    assert AuditEvent.objects.filter(action="vm.request_failed").exists()


def test_a_waiting_request_is_cancelled_at_google_too(cast, lab, tpu_emulator):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    vm_requests.cancel_request(cast.admin, made)
    made.refresh_from_db()
    assert made.state == "cancelled"
    assert tpu_emulator.controls.queued_resources() == {}
    # Cancelled, it no longer counts: the same name can be asked for again.
    vm_requests.request_vm(cast.admin, lab, spec(queued=True))


def test_a_name_the_lab_has_or_asked_for_is_refused(cast, lab, tpu_emulator):
    TpuVm.objects.create(lab=lab, name="tpu5", zone=ZONE, source="manual")
    assert "already has a TPU VM named tpu5" in refusal(cast, lab, tpu_emulator)["name"][0]


def _kept_alive_vm(cast, lab, tpu_emulator):
    from tpus.models import Grant

    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True, keep_alive=True))
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    return made, vm


def test_a_kept_alive_vm_that_google_preempts_comes_back_as_itself(cast, lab, tpu_emulator):
    from portal.models import OutboxMessage
    from tpus.services import sync

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    keys_before = {w.index: w.host_keys for w in vm.workers.all()}
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    vm.refresh_from_db()
    assert vm.state == "PREEMPTED"

    vm_request_work.follow_open()
    again = VmRequest.objects.exclude(pk=made.pk).get()
    assert (again.name, again.queued, again.keep_alive, again.vm_id) == ("tpu5", True, True, vm.pk)
    assert again.requested_by is None  # the portal asked, not a person
    vm_request_work.follow_open()  # the next pass does not ask twice
    assert VmRequest.objects.count() == 2

    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "ready"
    vm.refresh_from_db()
    assert vm.state == "READY" and TpuVm.objects.filter(lab=lab).count() == 1
    workers = list(vm.workers.all())
    # New host keys, pinned from what the new workers publish, and no alarm.
    assert all(w.is_pinned and not w.host_key_mismatch_at for w in workers)
    assert {w.index: w.host_keys for w in workers} != keys_before
    assert vm.grants.get(user=cast.member).state == "active"
    # Nobody is told before every worker has the accounts again …
    back = OutboxMessage.objects.filter(kind="vm_back")
    assert not back.exists() and vm.restore_version == vm.desired_version
    reconcile.settle_grants(vm.pk)
    assert not back.exists()
    # … then each person with access, once.
    for worker in workers:
        WorkerSync.objects.update_or_create(
            worker=worker, defaults={"applied_version": vm.desired_version}
        )
    reconcile.settle_grants(vm.pk)
    reconcile.settle_grants(vm.pk)
    assert [m.to for m in back] == [cast.member.email]
    assert "tpu5 is back" in back[0].subject
    # The next sync sees a node made anew and finds its published keys as pinned.
    report = sync.sync_inventory([lab])
    assert not Worker.objects.filter(vm=vm, host_key_mismatch_at__isnull=False).exists()
    assert report is not None


def test_a_vm_not_kept_alive_stays_preempted(cast, lab, tpu_emulator):
    from tpus.services import sync

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    VmRequest.objects.filter(pk=made.pk).update(keep_alive=False)
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    assert keep_alive.bring_back() == []
    assert VmRequest.objects.count() == 1


def test_the_admins_are_told_when_a_request_fails(cast, lab, tpu_emulator):
    from portal.models import OutboxMessage

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    tpu_emulator.controls.fail_request(made.cloud_id, "RESOURCE_EXHAUSTED", "Quota exceeded.")
    vm_request_work.send(made.pk)
    [message] = OutboxMessage.objects.filter(kind="vm_request_failed")
    assert message.to == cast.admin.email
    assert "Quota exceeded." in message.body


def test_a_request_still_waiting_well_past_its_window_is_failed_and_cancelled_by_the_portal(
    cast, lab, tpu_emulator
):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    # As if Google had kept it waiting although its window closed long ago.
    VmRequest.objects.filter(pk=made.pk).update(
        valid_until=timezone.now() - vm_request_work.WINDOW_GRACE - dt.timedelta(seconds=1)
    )
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "failed" and made.error_code == "DEADLINE_EXCEEDED"
    assert "capacity did not come before the end of its window" in made.error
    assert tpu_emulator.controls.queued_resources() == {}


def test_a_request_still_waiting_when_the_labs_grant_ends_is_withdrawn_and_makes_nothing(
    cast, lab, tpu_emulator
):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    vm_request_work.send(made.pk)
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)  # capacity comes too late

    vm_request_work.send(made.pk)

    made.refresh_from_db()
    assert made.state == "failed" and made.error_code == "GRANT_ENDED"
    assert "the lab's TPU grant ended on" in made.error
    assert tpu_emulator.controls.queued_resources() == {}
    assert not TpuVm.objects.filter(lab=lab).exists()
    assert tpu_emulator.requests["CreateNode"] == 0


def test_the_admins_hear_once_a_week_before_the_labs_grant_ends(cast, lab, tpu_emulator):
    from portal.models import OutboxMessage

    lab.grant_end_date = timezone.localdate() + dt.timedelta(days=6)
    lab.save()
    assert allowances.warn_grant_ending() == 1
    assert allowances.warn_grant_ending() == 0
    [message] = OutboxMessage.objects.filter(kind="lab_grant_ending")
    assert message.to == cast.admin.email
    assert "ends in 6 days" in message.subject
    assert "v4 spot: 0 of 16 chips" in message.body
    # A grant ending later than a week from now is not announced yet.
    lab.grant_end_date = timezone.localdate() + dt.timedelta(days=30)
    lab.save()
    assert allowances.warn_grant_ending() == 0


def test_a_marked_job_lost_before_the_sync_saw_the_preemption_runs_again(cast, lab, tpu_emulator):
    """The workers vanished under the job first (it ended lost, "rebooted"), then the
    sync saw the VM preempted: the keep-alive pass queues the job again, once."""
    from tpus.models import Job
    from tpus.services import sync
    from tpus.tests.jobs_support import make_job

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    made.refresh_from_db()
    from accounts.unix import choose_username

    choose_username(cast.member, "milo")
    ended = timezone.now()
    lost = make_job(vm, cast.member, "lost", rerun_after_preemption=True, ended_at=ended)
    before = make_job(
        vm, cast.member, "lost", rerun_after_preemption=True,
        ended_at=made.ready_at - dt.timedelta(minutes=5),
    )  # fmt: skip
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    vm_request_work.follow_open()
    vm_request_work.follow_open()
    [again] = Job.objects.filter(rerun_of__isnull=False)
    assert again.rerun_of_id == lost.pk and again.state == "queued"
    assert not Job.objects.filter(rerun_of=before).exists()  # lost in an earlier life


def test_a_failed_request_is_tried_again_as_a_new_one_and_an_open_one_is_not(
    cast, lab, tpu_emulator
):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True, keep_alive=True))
    vm_request_work.send(made.pk)
    with pytest.raises(ValidationError, match="this one is waiting for resources"):
        vm_requests.retry_request(cast.admin, VmRequest.objects.get(pk=made.pk))
    with pytest.raises(PermissionDenied):
        vm_requests.retry_request(cast.member, made)
    made.refresh_from_db()
    tpu_emulator.controls.fail_request(made.cloud_id, "RESOURCE_EXHAUSTED", "No capacity.")
    vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "failed"

    again = vm_requests.retry_request(cast.admin, made)
    assert again.pk != made.pk and again.requested_by == cast.admin
    fields = ("name", "zone", "accelerator_type", "runtime_version", "provisioning")
    assert [getattr(again, f) for f in fields] == [getattr(made, f) for f in fields]
    assert (again.queued, again.keep_alive) == (True, True)
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", None)
    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "ready", again.error
    assert TpuVm.objects.filter(lab=lab, name="tpu5").exists()
    # Up now: the failed one cannot be tried again (the name is the lab's).
    with pytest.raises(ValidationError, match="already has a TPU VM named tpu5"):
        vm_requests.retry_request(cast.admin, made)


def test_a_request_tried_again_after_its_window_drops_the_window(cast, lab, tpu_emulator):
    now = timezone.now()
    made = VmRequest.objects.create(
        lab=lab, requested_by=cast.admin, state="failed", queued=True,
        valid_after=now - dt.timedelta(days=2), valid_until=now - dt.timedelta(days=1),
        **{k: v for k, v in spec().__dict__.items() if k not in ("queued", "valid_after",
                                                                 "valid_until")},
    )  # fmt: skip
    again = vm_requests.retry_request(cast.admin, made)
    assert (again.valid_after, again.valid_until) == (None, None)


def test_a_kept_alive_vm_comes_back_with_the_disks_it_had_in_their_modes(cast, lab, tpu_emulator):
    from tpus.services import inventory, sync

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    disk = inventory.register_disk(
        cast.admin, lab, name="scratch", zone=ZONE, size_gb=10, mount_point="/scratch"
    )
    inventory.attach_disk(cast.admin, disk, vm, "READ_ONLY")
    source = f"projects/{PROJECT}/zones/{ZONE}/disks/scratch"
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    [again] = keep_alive.bring_back()
    version = TpuVm.objects.get(pk=vm.pk).desired_version
    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "ready"

    # What the portal asked Google for names the disk, and the new node has it.
    [sent] = [r for r in tpu_emulator.controls.queued_resources().values() if r["node_name"]]
    assert sent["node"]["data_disks"] == [{"source_disk": source, "mode": "READ_ONLY"}]
    node = tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5")
    assert [(d.source_disk, d.mode) for d in node.data_disks] == [(source, "READ_ONLY")]
    # The VM keeps its attachment, and its workers are made to mount it again.
    assert [(a.disk.name, a.mode) for a in vm.attachments.all()] == [("scratch", "READ_ONLY")]
    assert TpuVm.objects.get(pk=vm.pk).desired_version > version


def test_a_vm_asked_for_again_whose_read_write_disk_another_vm_took_fails_with_why(
    cast, lab, tpu_emulator
):
    from tpus.services import inventory, sync

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    tpu_emulator.controls.add_disk(PROJECT, ZONE, "scratch")
    disk = inventory.register_disk(
        cast.admin, lab, name="scratch", zone=ZONE, size_gb=10, mount_point="/scratch"
    )
    from tpus.models import DiskAttachment

    DiskAttachment.objects.create(disk=disk, vm=vm, mode="READ_WRITE")
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    [again] = keep_alive.bring_back()
    tpu_emulator.controls.add_node(PROJECT, ZONE, "other", accelerator_type="v4-8")
    tpu_emulator.controls.attach("other", "scratch", "READ_WRITE")
    vm_request_work.send(again.pk)
    again.refresh_from_db()
    assert again.state == "failed"
    assert "already being used by" in again.error


# --- no task waits for Google ----------------------------------------------------------

SEND = "tpus.tasks.send_vm_request"


def _timed(call) -> float:
    import time

    began = time.monotonic()
    call()
    return time.monotonic() - began


def _run_looks(queued, capture) -> list[float]:
    """Run each look at a request when it is due, as a worker would, until none is
    queued; how long each took."""
    import time

    took = []
    for _ in range(60):
        due = queued.take(SEND)
        if not due:
            break
        for args, countdown in due:
            time.sleep(countdown or 0)
            with capture(execute=True):
                took.append(_timed(lambda args=args: vm_request_work.send(*args)))
    return took


def test_a_direct_create_sends_the_call_and_looks_again_instead_of_waiting_for_google(
    cast, lab, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    tpu_emulator.operation_delay = 3.0  # Google takes its time to make the node
    made = vm_requests.request_vm(cast.admin, lab, spec())
    queued_tasks.tasks.clear()

    with django_capture_on_commit_callbacks(execute=True):
        took = [_timed(lambda: vm_request_work.send(made.pk))]
    made.refresh_from_db()
    assert made.state == "requested" and made.sent_at is not None
    assert (bool(made.operation), made.operation_call) == (True, "CreateNode")
    [(args, countdown)] = [(a, c) for n, a, c in queued_tasks.tasks if n == SEND]
    assert args == (made.pk,) and countdown == 1.0  # the first look comes soon
    vm_request_work.send(made.pk)  # the pass, before the look is due: leaves it to the look
    assert tpu_emulator.requests["GetOperation"] == 0

    took += _run_looks(queued_tasks, django_capture_on_commit_callbacks)

    assert max(took) < 1.5, took  # each look is one call, never the 3 s Google takes
    assert len(took) >= 2
    made.refresh_from_db()
    assert made.state == "ready" and made.operation == ""
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    assert all(w.is_pinned for w in vm.workers.all())
    assert VmConnection.objects.get(vm=vm).state == "connecting"
    assert tpu_emulator.requests["CreateNode"] == 1


def test_a_look_lost_with_its_task_is_taken_by_the_follow_pass(
    cast, lab, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    import time

    tpu_emulator.operation_delay = 0.5
    made = vm_requests.request_vm(cast.admin, lab, spec())
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    queued_tasks.tasks.clear()  # the look's task is lost (a broker restart)
    time.sleep(1.1)

    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.follow_open()
    [(args, countdown)] = queued_tasks.take(SEND)
    assert args == (made.pk,) and countdown is None
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "ready" and made.operation == ""
    assert tpu_emulator.requests["CreateNode"] == 1


def test_a_create_google_fails_after_taking_it_fails_as_a_refused_call_did(
    cast, lab, tpu_emulator, queued_tasks, settings, django_capture_on_commit_callbacks
):
    import time

    settings.TPU_API_OPERATION_TIMEOUT = 1
    tpu_emulator.operation_delay = 30.0
    made = vm_requests.request_vm(cast.admin, lab, spec())
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    time.sleep(1.1)
    queued_tasks.tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    made.refresh_from_db()
    # Past TPU_API_OPERATION_TIMEOUT, as the waiting call failed: retryable, so the
    # request stays asked for and the next pass sends it again.
    assert made.state == "requested" and made.operation == ""
    assert queued_tasks.take(SEND) == []


def test_cancelling_answers_at_once_and_googles_deletion_is_followed_after(
    cast, lab, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    assert VmRequest.objects.get(pk=made.pk).state == "waiting"
    tpu_emulator.operation_delay = 3.0  # Google takes its time to delete it
    queued_tasks.tasks.clear()

    with django_capture_on_commit_callbacks(execute=True):
        took = _timed(lambda: vm_requests.cancel_request(cast.admin, made))

    assert took < 1.5, took  # one call, never the 3 s Google takes
    made.refresh_from_db()
    assert made.state == "cancelled" and made.operation_call == "DeleteQueuedResource"
    assert AuditEvent.objects.filter(action="vm.request_cancelled").count() == 1
    looks = _run_looks(queued_tasks, django_capture_on_commit_callbacks)
    assert looks and max(looks) < 1.5
    made.refresh_from_db()
    assert (made.state, made.operation, made.error) == ("cancelled", "", "")
    assert tpu_emulator.controls.queued_resources() == {}


def test_a_cancel_google_does_not_carry_out_is_shown_on_the_request(
    cast, lab, tpu_emulator, queued_tasks, settings, django_capture_on_commit_callbacks
):
    import time

    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    made = vm_requests.request_vm(cast.admin, lab, spec(queued=True))
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    settings.TPU_API_OPERATION_TIMEOUT = 1
    tpu_emulator.operation_delay = 30.0
    with django_capture_on_commit_callbacks(execute=True):
        vm_requests.cancel_request(cast.admin, made)
    time.sleep(1.1)
    queued_tasks.tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.send(made.pk)
    made.refresh_from_db()
    assert made.state == "cancelled" and made.operation == ""
    assert made.error.startswith("Google Cloud did not cancel the request: ")
    assert "did not finish in time" in made.error


def test_a_kept_alive_vm_is_asked_for_again_with_no_task_waiting_for_its_leftovers_deletion(
    cast, lab, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    from tpus.services import sync

    made, vm = _kept_alive_vm(cast, lab, tpu_emulator)
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])
    with django_capture_on_commit_callbacks(execute=True):
        vm_request_work.follow_open()
    again = VmRequest.objects.exclude(pk=made.pk).get()
    tpu_emulator.operation_delay = 2.0  # each deletion and the new request take Google 2 s
    queued_tasks.tasks.clear()

    with django_capture_on_commit_callbacks(execute=True):
        took = [_timed(lambda: vm_request_work.send(again.pk))]
    again.refresh_from_db()
    # The queued resource of its first life goes first (with its node).
    assert (again.state, again.operation_call) == ("requested", "DeleteQueuedResource")
    took += _run_looks(queued_tasks, django_capture_on_commit_callbacks)

    assert max(took) < 1.5, took
    again.refresh_from_db()
    assert again.state == "ready" and again.operation == ""
    assert tpu_emulator.requests["CreateQueuedResource"] == 2  # the first life's, and this
    vm.refresh_from_db()
    assert vm.state == "READY"

"""Stop, start and delete a lab's TPU VM, against the emulator: deleting says first
what goes with it and needs the name typed; jobs are cancelled cleanly, everyone with
access is told once, the VM is deleted at Google and access ends; stop and start follow
the node's state. A VM registered by hand cannot be changed this way."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError
from django.urls import reverse

from portal.models import OutboxMessage
from tpus.models import Grant, Job, LabAllowance, TpuVm, VmRequest
from tpus.services import keep_alive, vm_lifecycle, vm_request_work, vm_requests
from tpus.services.vm_requests import VmSpec

PROJECT = "vision-project"
ZONE = "us-central2-b"


@pytest.fixture
def vm(cast, tpu_emulator):
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="on-demand", chips=8)
    made = vm_requests.request_vm(
        cast.admin,
        lab,
        VmSpec(
            name="tpu5", zone=ZONE, accelerator_type="v4-8",
            runtime_version="tpu-ubuntu2204-base", keep_alive=True,
        ),
    )  # fmt: skip
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    return vm


def _waiting_job(vm, user) -> Job:
    return Job.objects.create(vm=vm, user=user, host_id="20261127-abcdef", args=["true"])


def test_the_delete_page_says_what_goes_with_the_vm(client, cast, vm):
    _waiting_job(vm, cast.member)
    client.force_login(cast.admin)
    text = client.get(reverse("vm_delete", args=[cast.lab.slug, vm.pk])).content.decode()
    assert "1 person has access and loses it" in text
    assert "1 waiting job is cancelled" in text
    assert "The homes on its workers go with it" in text


def test_a_wrong_name_deletes_nothing(client, cast, vm, tpu_emulator):
    job = _waiting_job(vm, cast.member)
    client.force_login(cast.admin)
    answer = client.post(reverse("vm_delete", args=[cast.lab.slug, vm.pk]), {"name": "tpu6"})
    assert answer.status_code == 400
    assert "Type the VM&#x27;s name, tpu5, to delete it." in answer.content.decode()
    vm.refresh_from_db()
    job.refresh_from_db()
    assert vm.state == "READY" and job.state == "queued"
    assert not OutboxMessage.objects.filter(kind="vm_deleted").exists()
    assert tpu_emulator.requests["DeleteNode"] == 0


def test_deleting_cancels_jobs_tells_people_and_ends_access(client, cast, vm, tpu_emulator):
    job = _waiting_job(vm, cast.member)
    client.force_login(cast.admin)
    answer = client.post(reverse("vm_delete", args=[cast.lab.slug, vm.pk]), {"name": "tpu5"})
    assert answer.status_code == 302
    vm.refresh_from_db()
    job.refresh_from_db()
    assert vm.state == "DELETING"
    assert job.state == "cancelled" and "being deleted" in job.reason
    [told] = OutboxMessage.objects.filter(kind="vm_deleted")
    assert told.to == cast.member.email and "home" in told.body
    assert not VmRequest.objects.filter(vm=vm, keep_alive=True).exists()

    vm_lifecycle.run(vm.pk, vm_lifecycle.DELETE)  # the task
    assert tpu_emulator.client.list_nodes(PROJECT, ZONE) == []
    vm.refresh_from_db()
    assert vm.missing_since is not None
    assert Grant.objects.get(vm=vm).state == "revoked"
    assert keep_alive.bring_back() == []  # deleted on purpose: not brought back


def test_stop_and_start_follow_the_node(cast, vm, tpu_emulator):
    vm_lifecycle.stop_vm(cast.admin, vm)
    assert TpuVm.objects.get(pk=vm.pk).state == "STOPPING"
    vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    vm.refresh_from_db()
    assert vm.state == "STOPPED"
    with pytest.raises(ValidationError):
        vm_lifecycle.stop_vm(cast.admin, vm)
    vm_lifecycle.start_vm(cast.admin, vm)
    vm_lifecycle.run(vm.pk, vm_lifecycle.START)
    vm.refresh_from_db()
    assert vm.state == "READY"
    assert tpu_emulator.client.get_node(PROJECT, ZONE, "tpu5").state == "READY"


def test_a_vm_registered_by_hand_cannot_be_stopped_or_deleted(cast):
    manual = TpuVm.objects.create(lab=cast.lab, name="tpu9", zone="us-central1-f", source="manual")
    for change in (vm_lifecycle.stop_vm, vm_lifecycle.start_vm):
        with pytest.raises(ValidationError, match="registered by hand"):
            change(cast.admin, manual)
    with pytest.raises(ValidationError, match="registered by hand"):
        vm_lifecycle.delete_vm(cast.admin, manual, "tpu9")


def test_a_kept_alive_vm_the_lab_stopped_is_not_brought_back(cast, vm, tpu_emulator):
    vm_lifecycle.stop_vm(cast.admin, vm)
    vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    assert TpuVm.objects.get(pk=vm.pk).state == "STOPPED"
    assert keep_alive.bring_back() == []


FOLLOW = "tpus.tasks.follow_vm_change"


def _timed(call) -> float:
    import time

    started = time.monotonic()
    call()
    return time.monotonic() - started


def _follow(queued, django_capture_on_commit_callbacks) -> list[float]:
    """Run the looks the change queues, each when it is due, as a worker would; the
    seconds each took."""
    import time

    took = []
    while looks := queued.take(FOLLOW):
        [((change_id,), countdown)] = looks
        assert countdown >= 1
        time.sleep(countdown)
        with django_capture_on_commit_callbacks(execute=True):
            took.append(_timed(lambda change_id=change_id: vm_lifecycle.follow(change_id)))
    return took


def test_a_stop_and_a_start_send_the_call_and_look_again_later_instead_of_waiting(
    cast, vm, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    from tpus.models import VmChange

    tpu_emulator.operation_delay = 2.0  # Google takes its time
    queued = queued_tasks
    vm_lifecycle.stop_vm(cast.admin, vm)
    queued.tasks.clear()

    with django_capture_on_commit_callbacks(execute=True):
        took = [_timed(lambda: vm_lifecycle.run(vm.pk, vm_lifecycle.STOP))]
    # Underway: the page still says stopping, and the look is queued for later.
    assert TpuVm.objects.get(pk=vm.pk).state == "STOPPING"
    [change] = VmChange.objects.filter(vm=vm)
    assert change.operation and change.finished_at is None
    took += _follow(queued, django_capture_on_commit_callbacks)

    assert max(took) < 1.0, took
    assert len(took) >= 2
    vm.refresh_from_db()
    assert vm.state == "STOPPED"
    change.refresh_from_db()
    assert change.finished_at is not None

    version = vm.desired_version
    vm_lifecycle.start_vm(cast.admin, vm)
    queued.tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        vm_lifecycle.run(vm.pk, vm_lifecycle.START)
    assert TpuVm.objects.get(pk=vm.pk).state == "STARTING"
    _follow(queued, django_capture_on_commit_callbacks)
    vm.refresh_from_db()
    assert vm.state == "READY"
    assert vm.desired_version > version  # its workers are reconciled once it is up


def test_a_deletion_ends_access_once_google_has_deleted_the_vm(
    cast, vm, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    tpu_emulator.operation_delay = 1.5
    queued = queued_tasks
    vm_lifecycle.delete_vm(cast.admin, vm, "tpu5")
    queued.tasks.clear()
    with django_capture_on_commit_callbacks(execute=True):
        vm_lifecycle.run(vm.pk, vm_lifecycle.DELETE)
    assert Grant.objects.get(vm=vm).state == "active"  # not yet: Google is on it

    _follow(queued, django_capture_on_commit_callbacks)

    vm.refresh_from_db()
    assert vm.missing_since is not None
    assert Grant.objects.get(vm=vm).state == "revoked"


def test_a_lost_look_is_queued_again_by_the_sweep(
    cast, vm, tpu_emulator, queued_tasks, django_capture_on_commit_callbacks
):
    import datetime as dt
    import time

    from django.utils import timezone

    from tpus.models import VmChange
    from tpus.tasks import reconcile_sweep

    tpu_emulator.operation_delay = 0.5
    queued = queued_tasks
    vm_lifecycle.stop_vm(cast.admin, vm)
    with django_capture_on_commit_callbacks(execute=True):
        vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    [change] = VmChange.objects.filter(vm=vm)
    queued.tasks.clear()  # the look's task is lost (a broker restart)
    assert vm_lifecycle.lost_changes() == []
    VmChange.objects.filter(pk=change.pk).update(
        claimed_until=timezone.now() - dt.timedelta(seconds=61)
    )

    with django_capture_on_commit_callbacks(execute=True):
        reconcile_sweep()
    [(args, countdown)] = queued.take(FOLLOW)
    assert args == (change.pk,) and countdown is None
    time.sleep(0.6)  # Google is done meanwhile
    vm_lifecycle.follow(change.pk)
    vm_lifecycle.follow(change.pk)  # queued twice: looks once, and changes nothing more

    assert TpuVm.objects.get(pk=vm.pk).state == "STOPPED"
    assert VmChange.objects.get(pk=change.pk).finished_at is not None


def test_a_stop_google_does_not_finish_in_time_fails_as_before(
    cast, vm, tpu_emulator, queued_tasks, settings, django_capture_on_commit_callbacks
):
    import time

    from tpus.models import AuditEvent, VmChange

    settings.TPU_API_OPERATION_TIMEOUT = 1
    tpu_emulator.operation_delay = 30.0
    queued = queued_tasks
    vm_lifecycle.stop_vm(cast.admin, vm)
    with django_capture_on_commit_callbacks(execute=True):
        vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    time.sleep(1.1)
    [change] = VmChange.objects.filter(vm=vm)
    queued.tasks.clear()

    with django_capture_on_commit_callbacks(execute=True):
        vm_lifecycle.follow(change.pk)

    [failed] = AuditEvent.objects.filter(action="vm.change_failed")
    assert failed.summary.startswith("tpu5: stop failed: Cloud TPU API StopNode failed: ")
    assert "DEADLINE_EXCEEDED: the operation did not finish in time" in failed.summary
    assert [n for n, _, _ in queued.tasks] == ["tpus.tasks.sync_lab_inventory"]

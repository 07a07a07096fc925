"""A lab's allowance and its grant's end hold on every way the lab comes to hold chips,
against the emulator: requests made at the same moment, a stopped VM started again,
and a VM kept alive asked for again after Google took it back."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connections
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from portal.models import OutboxMessage
from tpus import queue
from tpus.models import AuditEvent, Grant, LabAllowance, TpuVm, VmRequest
from tpus.models.provisioning import OPEN_REQUEST_STATES
from tpus.services import allowances, keep_alive, sync, vm_lifecycle, vm_request_work, vm_requests
from tpus.services.vm_requests import VmSpec

PROJECT = "vision-project"
ZONE = "us-central2-b"


def _lab(cast, chips: int):
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="on-demand", chips=chips)
    return lab


def _spec(name: str, **fields) -> VmSpec:
    values = dict(
        name=name, zone=ZONE, accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base"
    )
    return VmSpec(**{**values, **fields})


# --- requests at the same moment -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_six_requests_at_once_against_room_for_two_make_exactly_two(
    cast, tpu_emulator, monkeypatch
):
    """Each v4-8 is 4 chips of an 8-chip allowance. All six pass the first check (the
    zone's offer and the count) before any is stored, as requests arriving together
    do; storing them counts again with the lab locked, so two are made and four are
    refused with the numbers. (On SQLite the transactions are serialised by its write
    lock, on PostgreSQL by the lab's row lock.)"""
    lab = _lab(cast, chips=8)
    tpu_emulator.controls.set_capacity(ZONE, "v4-8", 0)  # queued: nothing arrives meanwhile
    checked = threading.Barrier(6)
    original = vm_requests.check_spec

    def check_then_wait_for_the_others(lab, spec):
        spec = original(lab, spec)
        checked.wait(timeout=30)
        return spec

    monkeypatch.setattr(vm_requests, "check_spec", check_then_wait_for_the_others)
    made, refused, errors = [], [], []

    def ask(n: int) -> None:
        try:
            made.append(vm_requests.request_vm(cast.admin, lab, _spec(f"tpu{n}", queued=True)))
        except ValidationError as exc:
            refused.append(exc.message_dict["accelerator_type"][0])
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert not errors
    assert len(made) == 2 and len(refused) == 4
    assert set(refused) == {
        "A v4-8 is 4 v4 chips; the lab holds 8 on-demand v4 chips of its 8, so 0 are left."
    }
    assert VmRequest.objects.filter(lab=lab).count() == 2
    assert allowances.holding(lab, "v4", "on-demand") == 8


@pytest.mark.django_db(transaction=True)
def test_a_start_and_a_request_at_once_against_room_for_one_make_one(
    cast, tpu_emulator, monkeypatch
):
    """A start counts under the same lock as a request: with room for one more v4-8,
    starting a stopped one and asking for a new one at the same moment let one of the
    two through, whichever comes first."""
    lab = _lab(cast, chips=8)
    for name, state in (("tpu5", "STOPPED"), ("tpu6", "READY")):
        vm = TpuVm.objects.create(
            lab=lab, name=name, zone=ZONE, source="created", accelerator_type="v4-8",
            state=state,
        )  # fmt: skip
        VmRequest.objects.create(
            lab=lab, vm=vm, state="ready", **{**_spec(name).__dict__, "name": name}
        )
    queued = []  # the calls at Google are not the point here: only what was let through
    monkeypatch.setattr(queue, "change_vm", lambda vm_id, action: queued.append(action))
    monkeypatch.setattr(queue, "send_vm_request", lambda pk: queued.append("send"))
    stopped = TpuVm.objects.get(name="tpu5")
    together = threading.Barrier(2)
    done, refused, errors = [], [], []

    def run(work) -> None:
        try:
            together.wait(timeout=30)
            done.append(work())
        except ValidationError as exc:
            refused.append(" ".join(exc.messages))
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=run, args=(lambda: vm_lifecycle.start_vm(cast.admin, stopped),)),
        threading.Thread(
            target=run, args=(lambda: vm_requests.request_vm(cast.admin, lab, _spec("tpu7")),)
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert not errors
    assert len(done) == 1 and len(refused) == 1, (done, refused)
    assert "the lab holds 8 on-demand v4 chips of its 8, so 0 are left" in refused[0]
    assert allowances.holding(lab, "v4", "on-demand") == 8
    assert len(queued) == 1


# --- a stopped VM started again ---------------------------------------------------------


@pytest.fixture
def stopped(cast, tpu_emulator):
    """tpu5, a v4-8 (4 chips) the portal made, stopped, in a lab allowed 8 chips."""
    lab = _lab(cast, chips=8)
    made = vm_requests.request_vm(cast.admin, lab, _spec("tpu5", keep_alive=True))
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    vm_lifecycle.stop_vm(cast.admin, vm)
    vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    vm.refresh_from_db()
    assert vm.state == "STOPPED"
    return vm


def _two_more(cast, lab) -> None:
    """The room the stopped VM left is taken: two more v4-8 make 8 chips of 8."""
    for name in ("tpu6", "tpu7"):
        vm_request_work.send(vm_requests.request_vm(cast.admin, lab, _spec(name)).pk)


FULL = (
    "tpu5 cannot start: A v4-8 is 4 v4 chips; the lab holds 8 on-demand v4 chips of its 8, "
    "so 0 are left. A stopped VM holds none of the allowance: stop or delete another VM to "
    "make room, or ask a site admin to raise it."
)


def test_a_stopped_vm_whose_chips_were_taken_meanwhile_is_refused_start_with_the_numbers(
    cast, stopped, tpu_emulator
):
    _two_more(cast, stopped.lab)
    with pytest.raises(ValidationError) as refused:
        vm_lifecycle.start_vm(cast.admin, stopped)
    assert refused.value.messages == [FULL]
    stopped.refresh_from_db()
    assert stopped.state == "STOPPED"
    assert tpu_emulator.requests["StartNode"] == 0
    assert not AuditEvent.objects.filter(action="vm.start_requested").exists()
    assert allowances.holding(stopped.lab, "v4", "on-demand") == 8

    # Room made (another VM stopped): it starts.
    other = vm_lifecycle.stop_vm(cast.admin, TpuVm.objects.get(lab=stopped.lab, name="tpu6"))
    vm_lifecycle.run(other.pk, vm_lifecycle.STOP)
    vm_lifecycle.start_vm(cast.admin, stopped)
    assert TpuVm.objects.get(pk=stopped.pk).state == "STARTING"


def test_the_page_and_the_api_say_why_a_start_is_refused(client, cast, stopped, tpu_emulator):
    from accounts.services import create_token

    _two_more(cast, stopped.lab)
    client.force_login(cast.admin)
    page = client.post(
        reverse("vm_power", args=[stopped.lab.slug, stopped.pk, "start"]), follow=True
    )
    assert FULL.replace("'", "&#x27;") in page.content.decode()
    _, raw = create_token(cast.admin, "script")
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {raw}").post(
        f"/api/v1/labs/{stopped.lab.slug}/vms/{stopped.pk}/start"
    )
    assert answer.status_code == 400 and answer.json()["detail"] == FULL
    assert TpuVm.objects.get(pk=stopped.pk).state == "STOPPED"


def test_a_stopped_vm_does_not_start_after_the_labs_grant_ended(cast, stopped, tpu_emulator):
    stopped.lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    stopped.lab.save()
    with pytest.raises(ValidationError) as refused:
        vm_lifecycle.start_vm(cast.admin, stopped)
    assert refused.value.messages[0].startswith("tpu5 cannot start: The lab's TPU grant ended")
    assert TpuVm.objects.get(pk=stopped.pk).state == "STOPPED"
    assert tpu_emulator.requests["StartNode"] == 0


def test_an_imported_vm_the_lab_has_no_allowance_for_starts_until_the_grant_ends(cast):
    """A VM the lab made itself, of a kind it has no allowance for, is outside what the
    portal keeps count of: only the grant's end holds it."""
    LabAllowance.objects.create(lab=cast.lab, generation="v4", provisioning="spot", chips=4)
    vm = TpuVm.objects.create(
        lab=cast.lab, name="tpu9", zone="us-central1-f", source="imported",
        accelerator_type="v4-8", state="STOPPED",
    )  # fmt: skip
    cast.lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    cast.lab.save()
    with pytest.raises(ValidationError, match="tpu9 cannot start: The lab's TPU grant ended"):
        vm_lifecycle.start_vm(cast.admin, vm)
    cast.lab.grant_end_date = timezone.localdate()
    cast.lab.save()
    assert vm_lifecycle.start_vm(cast.admin, vm).state == "STARTING"


# --- a VM kept alive, asked for again after Google took it back ---------------------------


@pytest.fixture
def kept(cast, tpu_emulator):
    """tpu5, a spot v4-32 (16 chips) kept alive, the whole of a 16-chip spot allowance;
    milo has access to it."""
    lab = cast.lab
    lab.gcp_project_id, lab.zones = PROJECT, [ZONE]
    lab.save()
    LabAllowance.objects.create(lab=lab, generation="v4", provisioning="spot", chips=16)
    made = vm_requests.request_vm(
        cast.admin, lab,
        _spec("tpu5", accelerator_type="v4-32", provisioning="spot", queued=True,
              keep_alive=True),
    )  # fmt: skip
    vm_request_work.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    Grant.objects.create(user=cast.member, vm=vm, state="active")
    return vm


def _preempt(lab, tpu_emulator) -> None:
    tpu_emulator.controls.preempt("tpu5")
    sync.sync_inventory([lab])


def _asked_again(vm) -> bool:
    return VmRequest.objects.filter(vm=vm, state__in=OPEN_REQUEST_STATES).exists()


def test_a_kept_alive_vm_is_not_asked_for_again_after_the_labs_grant_ended(
    client, cast, kept, tpu_emulator
):
    lab = kept.lab
    _preempt(lab, tpu_emulator)
    lab.grant_end_date = timezone.localdate() - dt.timedelta(days=1)
    lab.save()
    calls = tpu_emulator.requests["CreateQueuedResource"]

    assert keep_alive.bring_back() == []
    assert keep_alive.bring_back() == []  # the next pass: still down, told once
    assert not _asked_again(kept)
    assert tpu_emulator.requests["CreateQueuedResource"] == calls
    assert TpuVm.objects.get(pk=kept.pk).state == "PREEMPTED"
    duty = VmRequest.objects.get(vm=kept, keep_alive=True)
    assert duty.kept_down.startswith("The lab's TPU grant ended on")
    [told] = OutboxMessage.objects.filter(kind="vm_kept_down")
    assert told.to == cast.admin.email and "tpu5 stays down" in told.subject
    assert duty.kept_down in " ".join(told.body.split())
    [event] = AuditEvent.objects.filter(action="vm.kept_down")
    assert event.summary.startswith("tpu5 in us-central2-b stays down: The lab's TPU grant ended")
    # The VM's page says why, to its admins and to the people with access.
    for person in (cast.admin, cast.member):
        client.force_login(person)
        page = client.get(reverse("vm_detail", args=[lab.slug, kept.pk])).content.decode()
        assert "has not asked Google for it again" in page
        assert "TPU grant ended on" in page

    # A site admin moves the grant's end: the next pass asks for it, by itself.
    lab.grant_end_date = timezone.localdate() + dt.timedelta(days=30)
    lab.save()
    [again] = keep_alive.bring_back()
    assert again.vm_id == kept.pk and again.keep_alive
    assert not VmRequest.objects.filter(kept_down_since__isnull=False).exists()
    assert keep_alive.held_down(kept) is None


def test_a_kept_alive_vm_whose_chips_were_taken_stays_down_until_they_are_free(
    cast, kept, tpu_emulator
):
    lab = kept.lab
    _preempt(lab, tpu_emulator)
    # While tpu5 is down it holds nothing: the lab makes tpu6 with its 16 chips.
    other = vm_requests.request_vm(
        cast.admin, lab, _spec("tpu6", accelerator_type="v4-32", provisioning="spot")
    )
    vm_request_work.send(other.pk)

    assert keep_alive.bring_back() == []
    assert not _asked_again(kept)
    duty = VmRequest.objects.get(vm=kept, keep_alive=True)
    assert duty.kept_down == (
        "A v4-32 is 16 v4 chips; the lab holds 16 spot v4 chips of its 16, so 0 are left."
    )
    assert OutboxMessage.objects.filter(kind="vm_kept_down").count() == 1
    assert allowances.holding(lab, "v4", "spot") == 16

    # tpu6 deleted: the chips are free and tpu5 is asked for again, and counts.
    tpu6 = TpuVm.objects.get(lab=lab, name="tpu6")
    vm_lifecycle.delete_vm(cast.admin, tpu6, "tpu6")
    vm_lifecycle.run(tpu6.pk, vm_lifecycle.DELETE)
    [again] = keep_alive.bring_back()
    assert again.vm_id == kept.pk
    assert allowances.holding(lab, "v4", "spot") == 16
    vm_request_work.send(again.pk)
    assert TpuVm.objects.get(pk=kept.pk).state == "READY"

    # Taken back and refused again later: a new spell, told again once.
    _preempt(lab, tpu_emulator)
    LabAllowance.objects.filter(lab=lab).update(chips=8)
    assert keep_alive.bring_back() == []
    assert keep_alive.bring_back() == []
    assert OutboxMessage.objects.filter(kind="vm_kept_down").count() == 2
    assert AuditEvent.objects.filter(action="vm.kept_down").count() == 2


def test_a_request_made_while_a_kept_alive_vm_is_asked_for_again_counts_it(
    cast, kept, tpu_emulator
):
    """Once asked for again, the VM's new request holds its chips: the lab cannot make
    another in its place."""
    _preempt(kept.lab, tpu_emulator)
    tpu_emulator.controls.set_capacity(ZONE, "v4-32", 0)
    [again] = keep_alive.bring_back()
    with pytest.raises(ValidationError, match="holds 16 spot v4 chips of its 16"):
        vm_requests.request_vm(
            cast.admin, kept.lab, _spec("tpu6", accelerator_type="v4-32", provisioning="spot")
        )
    assert again.is_open

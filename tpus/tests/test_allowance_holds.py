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

from tpus.models import AuditEvent, LabAllowance, TpuVm, VmRequest
from tpus.services import allowances, vm_lifecycle, vm_requests
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


# --- a stopped VM started again ---------------------------------------------------------


@pytest.fixture
def stopped(cast, tpu_emulator):
    """tpu5, a v4-8 (4 chips) the portal made, stopped, in a lab allowed 8 chips."""
    lab = _lab(cast, chips=8)
    made = vm_requests.request_vm(cast.admin, lab, _spec("tpu5", keep_alive=True))
    vm_requests.send(made.pk)
    vm = TpuVm.objects.get(lab=lab, name="tpu5")
    vm_lifecycle.stop_vm(cast.admin, vm)
    vm_lifecycle.run(vm.pk, vm_lifecycle.STOP)
    vm.refresh_from_db()
    assert vm.state == "STOPPED"
    return vm


def _two_more(cast, lab) -> None:
    """The room the stopped VM left is taken: two more v4-8 make 8 chips of 8."""
    for name in ("tpu6", "tpu7"):
        vm_requests.send(vm_requests.request_vm(cast.admin, lab, _spec(name)).pk)


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


def test_an_imported_vm_of_a_lab_without_allowance_starts_until_the_grant_ends(cast):
    """The portal never counted the chips of a lab it makes nothing for: only the
    grant's end holds such a lab's own VMs."""
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

"""A lab's allowance and its grant's end hold on every way the lab comes to hold chips,
against the emulator: requests made at the same moment, a stopped VM started again,
and a VM kept alive asked for again after Google took it back."""

from __future__ import annotations

import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connections

from tpus.models import LabAllowance, VmRequest
from tpus.services import allowances, vm_requests
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

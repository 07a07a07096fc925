"""When the portal looks at who holds a VM's chips outside it: the scheduled pass
looks at a bounded number of idle VMs a run, least recently looked at first."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.cache import cache
from django.utils import timezone

from tpus import queue
from tpus.models import TpuVm
from tpus.services import holders
from tpus.tasks import look_at_idle_chips
from tpus.tests import jobs_support
from tpus.tests.jobs_support import make_job, make_vm

pytestmark = pytest.mark.django_db
scene = jobs_support.scene


@pytest.fixture
def looks(monkeypatch, settings):
    """The VMs the pass queues a look at, through the queue's door."""
    settings.PORTAL_HOLDER_PASS_VMS = 3
    settings.PORTAL_HOLDER_MAX_AGE_SECONDS = 600
    queued: list[int] = []
    monkeypatch.setattr(queue, "check_tpu_usage", queued.append)
    yield queued


def _idle(scene, count: int) -> list[TpuVm]:
    """``count`` VMs no job holds, looked at 1, 2, … hours ago (the last the oldest)."""
    now = timezone.now()
    vms = [
        make_vm(scene.lab, f"idle{n}", usage_checked_at=now - dt.timedelta(hours=n + 1))
        for n in range(count)
    ]
    for vm in [scene.vm, *vms]:
        cache.delete(f"tpu-portal:usage-look:{vm.pk}")
    return vms


def test_the_pass_looks_at_a_bounded_number_of_vms_least_recently_looked_at_first(scene, looks):
    idle = _idle(scene, 5)
    # scene.vm was never looked at: it comes first, then the oldest looks.
    look_at_idle_chips()
    assert looks == [scene.vm.pk, idle[4].pk, idle[3].pk]
    # They are stamped as asked, so the next run takes the next ones in line.
    looks.clear()
    look_at_idle_chips()
    assert looks == [idle[2].pk, idle[1].pk, idle[0].pk]


def test_a_vm_that_never_answers_goes_to_the_back_of_the_line(scene, looks):
    idle = _idle(scene, 4)
    now = timezone.now()
    first = holders.look_at_idle_vms(now=now)
    assert first == [scene.vm.pk, idle[3].pk, idle[2].pk]
    # Nobody answered (usage_checked_at unchanged). Past the age limit, the pass turns
    # to the VMs it has not asked since, before asking the same ones again.
    later = now + dt.timedelta(seconds=601)
    for vm in [scene.vm, *idle]:
        cache.delete(f"tpu-portal:usage-look:{vm.pk}")
    assert holders.look_at_idle_vms(now=later) == [idle[1].pk, idle[0].pk, scene.vm.pk]


def test_the_pass_skips_vms_a_job_holds_that_are_down_or_were_looked_at_lately(
    scene, looks, settings
):
    now = timezone.now()
    busy = make_vm(scene.lab, "busy")
    make_job(busy, scene.milo, "running")  # its poll looks already
    stopped = make_vm(scene.lab, "stopped", state=TpuVm.State.STOPPED)
    gone = make_vm(scene.lab, "gone", missing_since=now)
    bare = make_vm(scene.lab, "bare", workers=0)
    recent = make_vm(scene.lab, "recent", usage_checked_at=now - dt.timedelta(seconds=60))
    asked = make_vm(scene.lab, "asked", holders_looked_at=now - dt.timedelta(seconds=60))
    for vm in (scene.vm, busy, stopped, gone, bare, recent, asked):
        cache.delete(f"tpu-portal:usage-look:{vm.pk}")
    settings.PORTAL_HOLDER_PASS_VMS = 50
    assert holders.look_at_idle_vms() == [scene.vm.pk]
    assert looks == [scene.vm.pk]
    settings.PORTAL_HOLDER_PASS_VMS = 0  # off
    looks.clear()
    assert holders.look_at_idle_vms(now=now + dt.timedelta(days=1)) == [] and looks == []


def test_a_vm_page_already_asking_is_not_asked_again_by_the_pass(scene, looks):
    cache.delete(f"tpu-portal:usage-look:{scene.vm.pk}")
    assert holders.claim_look(scene.vm.pk)  # a page queued a look a moment ago
    assert holders.look_at_idle_vms() == []
    assert looks == []


def test_the_pass_costs_the_same_queries_for_many_vms_as_for_few(
    scene, looks, django_assert_max_num_queries
):
    _idle(scene, 2)
    with django_assert_max_num_queries(2):
        holders.look_at_idle_vms(now=timezone.now() + dt.timedelta(days=1))
    for n in range(30):
        make_vm(scene.lab, f"more{n}")
    with django_assert_max_num_queries(2):
        holders.look_at_idle_vms(now=timezone.now() + dt.timedelta(days=2))

"""Background work has one door: ``tpus.queue`` enqueues it, after commit; services
and the accounts app never import the tasks; tasks stay thin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tpus import queue
from tpus.models import ZoneSync

ROOT = Path(__file__).resolve().parents[2]
ENQUEUE_CALLS = {"delay", "delay_on_commit", "apply_async", "send_task"}


def shipped_modules():
    for package in ("accounts", "portal", "tpus", "bench", "testfleet"):
        for path in (ROOT / package).rglob("*.py"):
            if "tests" not in path.relative_to(ROOT).parts:
                yield path


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_service_and_nothing_in_accounts_imports_the_tasks():
    offenders = [
        str(path.relative_to(ROOT))
        for path in shipped_modules()
        if path.is_relative_to(ROOT / "tpus" / "services") or path.is_relative_to(ROOT / "accounts")
        if "tpus.tasks" in imports_of(path)
    ]
    assert offenders == []


def test_only_the_queue_module_hands_work_to_celery():
    offenders = []
    for path in shipped_modules():
        if path == ROOT / "tpus" / "queue.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ENQUEUE_CALLS
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


TASK_MODULES = sorted((ROOT / "tpus" / "tasks").glob("*.py"))


def test_every_task_is_at_most_fifteen_lines():
    long = [
        f"{path.name} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for path in TASK_MODULES
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 15
    ]
    assert TASK_MODULES and long == []


def test_the_task_modules_stay_small_and_every_task_keeps_its_package_name():
    from portal.celery import app

    assert [p.name for p in TASK_MODULES if len(p.read_text().splitlines()) > 120] == []
    ours = {name for name in app.tasks if name.startswith("tpus.")}
    assert ours and all(name.count(".") == 2 and name.startswith("tpus.tasks.") for name in ours)


def test_every_name_the_queue_uses_is_a_registered_task():
    from portal.celery import app

    source = (ROOT / "tpus" / "queue.py").read_text()
    names = {
        node.args[0].value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "_on_commit"
        and isinstance(node.args[0], ast.Constant)
    }
    assert names and names <= set(app.tasks)


def _lab_to_list(cast):
    """A lab with one zone; listing it reaches a closed port (the tests' Cloud TPU API)
    and records the failure: the trace that the queued sync ran."""
    cast.lab.gcp_project_id, cast.lab.zones = "vision-project", ["us-central1-f"]
    cast.lab.save()
    return ZoneSync.objects.filter(lab=cast.lab, last_failure_at__isnull=False)


@pytest.mark.django_db(transaction=True)
def test_queued_work_runs_only_once_the_transaction_commits(cast):
    from django.db import transaction

    listed = _lab_to_list(cast)
    with transaction.atomic():
        queue.refresh_lab(cast.lab.pk)
        assert not listed.exists()
    assert listed.exists()


@pytest.mark.django_db(transaction=True)
def test_queued_work_is_dropped_when_the_transaction_rolls_back(cast):
    from django.db import transaction

    listed = _lab_to_list(cast)
    with pytest.raises(RuntimeError), transaction.atomic():
        queue.refresh_lab(cast.lab.pk)
        raise RuntimeError("rolled back")
    assert not listed.exists()
    queue.refresh_lab(cast.lab.pk)  # outside a transaction: at once
    assert listed.exists()


def test_reconciles_gathered_queue_each_vm_once_after_commit(
    db, queued_tasks, django_capture_on_commit_callbacks
):
    from django.db import transaction

    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic(), queue.reconciles_gathered():
            queue.reconcile_vm(5)
            with queue.reconciles_gathered():
                queue.reconcile_vm(5)
            queue.reconcile_vm(6)
            assert queued_tasks.tasks == []
    assert queued_tasks.take("tpus.tasks.reconcile_vm") == [((5,), None), ((6,), None)]
    with django_capture_on_commit_callbacks(execute=True):
        queue.reconcile_vm(5)  # outside: as before, one each time
        queue.reconcile_vm(5)
    assert len(queued_tasks.take("tpus.tasks.reconcile_vm")) == 2


def test_reconciles_gathered_queue_nothing_when_left_by_an_error(
    db, queued_tasks, django_capture_on_commit_callbacks
):
    from django.db import transaction

    with django_capture_on_commit_callbacks(execute=True):
        with pytest.raises(RuntimeError), transaction.atomic(), queue.reconciles_gathered():
            queue.reconcile_vm(5)
            raise RuntimeError("rolled back")
    assert queued_tasks.take("tpus.tasks.reconcile_vm") == []

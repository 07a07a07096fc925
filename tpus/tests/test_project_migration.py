"""Upgrading a portal where two labs share a GCP project stops with a message that
names them, instead of picking a lab to keep the project."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def _targets():
    """The migration that makes project ids unique, and the state just before it
    (found by name, so renumbering does not break this test)."""
    graph = MigrationExecutor(connection).loader.graph
    key = next(
        k for k in graph.nodes if k[0] == "tpus" and k[1].endswith("_one_lab_per_gcp_project")
    )
    (before,) = [parent.key for parent in graph.node_map[key].parents if parent.key[0] == "tpus"]
    return [before], [key]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_labs_that_share_a_project_stop_the_upgrade_with_their_names():
    before, after = _targets()
    old = _migrate(before)
    Lab = old.get_model("tpus", "Lab")
    Lab.objects.create(name="A", slug="lab-a", gcp_project_id="shared-project")
    Lab.objects.create(name="B", slug="lab-b", gcp_project_id="shared-project")
    Lab.objects.create(name="C", slug="lab-c", gcp_project_id="own-project")
    try:
        with pytest.raises(RuntimeError, match=r"shared-project \(lab-a, lab-b\)") as refused:
            _migrate(after)
        assert "own-project" not in str(refused.value)
        Lab.objects.filter(slug="lab-b").update(gcp_project_id="other-project")
        _migrate(after)
    finally:
        Lab.objects.all().delete()
        _migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())

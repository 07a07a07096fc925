"""docs/grafana-dashboard.json graphs only what ``/metrics`` exports: a renamed or
dropped metric fails here, not on the operator's wall."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from portal.metrics import histograms
from portal.tests.metrics_support import scrape

pytestmark = pytest.mark.django_db

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(portal_[a-z0-9_]+)\b")
# Names of other exporters' metrics (celery_…, django_…, process_…) have no place here.
FOREIGN = re.compile(r"\b(?!portal_)[a-z]+_[a-z0-9_]*_(?:total|seconds|bucket|count|sum|bytes)\b")


def _queries(node) -> list[str]:
    """Every PromQL text in the dashboard: panels' targets and template variables."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found += _queries(value)
    elif isinstance(node, list):
        for item in node:
            found += _queries(item)
    return found


def test_every_query_of_the_dashboard_names_only_metrics_the_portal_exports(
    client, settings, make_lab
):
    make_lab(slug="vision")  # the per-lab series
    for name, spec in histograms.HISTOGRAMS.items():  # a series of each, labels and all
        histograms.observe(name, 1.0, **{label: "x" for label in spec.labels})
    exported = scrape(client, settings).sample_names()
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 15
    used = set()
    for query in queries:
        names = set(METRIC.findall(query))
        assert names, f"a query that reads none of the portal's metrics: {query}"
        assert names <= exported, f"{query} names {names - exported}, not exported"
        assert not FOREIGN.findall(query), query
        used |= names
    # Every family the endpoint exports is on the dashboard.
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported}
    assert families <= {re.sub(r"_(bucket|count|sum)$", "", n) for n in used}


def test_the_dashboard_asks_for_its_prometheus_data_source_on_import():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in panels)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])

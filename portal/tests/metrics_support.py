"""Reading ``/metrics`` in tests as Prometheus would: the text parsed by the official
client's own parser, samples looked up by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

TOKEN = "metrics-token-for-tests-" + "x" * 20


class Scrape:
    """One parsed exposition: families by name, and each sample's value."""

    def __init__(self, text: str):
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        found = [
            s.value
            for family in self.families.values()
            for s in family.samples
            if s.name == sample and s.labels == labels
        ]
        assert len(found) == 1, f"{sample}{labels}: {len(found)} samples in\n{self.text}"
        return found[0]

    def labels_of(self, sample: str, label: str) -> set[str]:
        return {
            s.labels[label]
            for family in self.families.values()
            for s in family.samples
            if s.name == sample and label in s.labels
        }

    def sample_names(self) -> set[str]:
        return {s.name for family in self.families.values() for s in family.samples}


def scrape(client, settings) -> Scrape:
    settings.PORTAL_METRICS_TOKEN = TOKEN
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    return Scrape(response.content.decode())

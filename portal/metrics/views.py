"""``/metrics``: the portal's figures in Prometheus' text format, for the operator's
monitoring (docs/deploy.md). Not public: ``portal.metrics.access`` says who may read
it, and with nothing configured the page does not exist (404)."""

from __future__ import annotations

from django.http import Http404, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from portal.metrics import figures, histograms
from portal.metrics.access import Verdict, verdict


class PortalCollector:
    """Everything is read at scrape time (figures) or from the database (histograms):
    no process keeps a figure of its own, so every web process answers the same."""

    def collect(self):
        yield from figures.families()
        yield from histograms.families()


def exposition() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PortalCollector())
    return generate_latest(registry)


@never_cache
@require_GET
def metrics(request):
    found = verdict(request)
    if found is Verdict.OFF:
        raise Http404
    if found is Verdict.UNAUTHENTICATED:
        response = HttpResponse(
            "A bearer token is needed.\n", status=401, content_type="text/plain"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if found is Verdict.OUTSIDE:
        return HttpResponse("Not from an allowed network.\n", status=403, content_type="text/plain")
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)

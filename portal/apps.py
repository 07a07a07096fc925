from django.apps import AppConfig


class PortalConfig(AppConfig):
    """The project itself: system checks that concern the whole deployment."""

    name = "portal"
    verbose_name = "TPU Portal"

    def ready(self) -> None:
        from portal import (
            checks,  # noqa: F401  (registers the checks)
            tasks,  # noqa: F401  (registers the outbox sweep; see tpus.apps)
        )
        from portal.metrics import task_timing  # noqa: F401  (times every Celery task)

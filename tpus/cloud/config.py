"""The portal's Cloud TPU client, configured from Django settings."""

from __future__ import annotations

import functools

from django.conf import settings

from tpus.cloud.client import CloudConfig, CloudTPU


def config_from_settings() -> CloudConfig:
    return CloudConfig(
        endpoint=settings.TPU_API_ENDPOINT,
        insecure=settings.TPU_API_INSECURE,
        credentials_file=settings.TPU_API_CREDENTIALS_FILE,
        timeout=float(settings.TPU_API_TIMEOUT),
        operation_timeout=float(settings.TPU_API_OPERATION_TIMEOUT),
    )


def cloud_tpu() -> CloudTPU:
    """The process's client for the current settings.

    One per configuration, so its channel (and its call counter) is shared by every
    caller; changed settings (tests) get a fresh one. Built on first use, which in a
    forked Celery worker is after the fork, as gRPC requires.
    """
    return _client_for(config_from_settings())


@functools.lru_cache(maxsize=8)
def _client_for(config: CloudConfig) -> CloudTPU:
    return CloudTPU(config)

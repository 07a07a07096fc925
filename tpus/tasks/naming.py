"""Every task is registered as ``tpus.tasks.<function>``: the name ``tpus.queue`` sends
and workers already running know, whichever module of the package holds it."""

from __future__ import annotations

from celery import shared_task


def task(**options):
    """``@shared_task`` under the package's name for the function."""

    def register(function):
        return shared_task(name=f"tpus.tasks.{function.__name__}", **options)(function)

    return register

"""Fixtures for the tpus app's tests."""

from __future__ import annotations

import pytest

from tpus.emulator.testing import RunningEmulator, start_emulator


@pytest.fixture
def tpu_emulator(tmp_path, settings) -> RunningEmulator:
    """A Cloud TPU API emulator on a free 127.0.0.1 port with an empty lab.

    Yields a ``RunningEmulator``: ``.controls`` sets the scene (``add_node``,
    ``maintenance``, ``fail``...), ``.client`` is a portal ``CloudTPU`` with fast
    retries and polling, and the portal's settings point at it, so ``cloud_tpu()``
    in the code under test talks to it too.
    """
    emulator = start_emulator(tmp_path / "tpu-emulator.json")
    settings.TPU_API_ENDPOINT = emulator.endpoint
    settings.TPU_API_INSECURE = True
    settings.TPU_API_CREDENTIALS_FILE = ""
    try:
        yield emulator
    finally:
        emulator.stop()

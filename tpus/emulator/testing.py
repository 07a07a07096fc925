"""Helpers for tests: run the emulator in this process and talk to it.

``tpus/tests/conftest.py`` turns ``start_emulator`` into the ``tpu_emulator`` fixture.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

from tpus.cloud import CloudConfig, CloudTPU
from tpus.emulator.controls import Controls
from tpus.emulator.server import EmulatorServer


def fast_config(endpoint: str, **overrides) -> CloudConfig:
    """A client configuration for the emulator with test-speed retries and polling."""
    values = dict(
        endpoint=endpoint,
        insecure=True,
        timeout=10.0,
        operation_timeout=10.0,
        retry_initial=0.01,
        retry_maximum=0.05,
        poll_initial=0.01,
        poll_multiplier=1.5,
        poll_maximum=0.1,
        metadata_retry_pause=0.01,
    )
    values.update(overrides)
    return CloudConfig(**values)


@dataclasses.dataclass
class RunningEmulator:
    """An emulator serving on 127.0.0.1, its controls, and a portal client for it."""

    server: EmulatorServer
    controls: Controls
    client: CloudTPU
    state_file: Path

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    @property
    def requests(self) -> Counter[str]:
        """Calls the server answered, by method name, as the server saw them."""
        return self.server.emulator.requests

    @property
    def operation_delay(self) -> float:
        return self.server.emulator.operations.delay

    @operation_delay.setter
    def operation_delay(self, seconds: float) -> None:
        self.server.emulator.operations.delay = seconds

    @property
    def environ(self) -> dict[str, str]:
        """Environment for a portal process (a Celery worker, a CLI) that should use it."""
        return {
            "TPU_API_ENDPOINT": self.endpoint,
            "TPU_API_INSECURE": "true",
            "TPU_EMULATOR_STATE": str(self.state_file),
            "NO_GCE_CHECK": "true",
            "no_proxy": "127.0.0.1,localhost," + os.environ.get("no_proxy", ""),
        }

    def client_with(self, **overrides) -> CloudTPU:
        """Another portal client for this emulator, e.g. with a different page size."""
        return CloudTPU(fast_config(self.endpoint, **overrides))

    def stop(self) -> None:
        self.server.stop(grace=None)


def start_emulator(state_file: str | os.PathLike[str], **server_options) -> RunningEmulator:
    """Serve the emulator on a free 127.0.0.1 port from threads of this process."""
    server = EmulatorServer(state_file, port=0, **server_options).start()
    return RunningEmulator(
        server=server,
        controls=server.controls,
        client=CloudTPU(fast_config(server.endpoint)),
        state_file=Path(state_file),
    )

"""Start the emulator's gRPC server (in a thread pool of this process)."""

from __future__ import annotations

import os
from concurrent import futures

import grpc

from tpus.emulator.controls import Controls
from tpus.emulator.service import TpuEmulator

LOOPBACK = "127.0.0.1"


class EmulatorServer:
    """A running (after ``start()``) Cloud TPU API emulator on ``host:port``."""

    def __init__(
        self,
        state_file: str | os.PathLike[str],
        *,
        host: str = LOOPBACK,
        port: int = 0,
        operation_delay: float = 0.0,
        max_workers: int = 8,
    ):
        self.controls = Controls(state_file)
        self.emulator = TpuEmulator(self.controls, operation_delay=operation_delay)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tpu-emulator"),
            handlers=self.emulator.handlers(),
            # Without this a second emulator could silently share the port.
            options=[("grpc.so_reuseport", 0)],
        )
        self.host = host
        # Port 0 picks a free port; gRPC raises RuntimeError when the port is taken.
        self.port = self._server.add_insecure_port(f"{host}:{port}")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> EmulatorServer:
        self._server.start()
        return self

    def stop(self, grace: float | None = 0.5) -> None:
        self._server.stop(grace).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()

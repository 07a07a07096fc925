"""A Cloud TPU API emulator that speaks the real gRPC protocol.

The unmodified ``google.cloud.tpu_v2.TpuClient`` talks to it over a real channel. Its
lab (nodes, workers, IPs, host keys, disks, injected faults) lives in a JSON state
file that ``Controls`` and ``python -m tpus.emulator`` change while it runs. Tests and
the demo use it; production never does. See docs/emulator.md.
"""

from tpus.emulator.controls import ControlError, Controls
from tpus.emulator.server import EmulatorServer

__all__ = ["ControlError", "Controls", "EmulatorServer"]

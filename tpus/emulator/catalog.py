"""What the emulated Cloud TPU API offers: accelerator types (how many workers and
which topology each has) and runtime versions. Every other part of the emulator reads
these; this module reads none of them."""

from __future__ import annotations

import re

ACCELERATOR_TYPES = ["v2-8", "v3-8", "v4-8", "v4-16", "v4-32", "v5litepod-8", "v5p-8", "v6e-8"]
RUNTIME_VERSIONS = ["tpu-ubuntu2204-base", "tpu-vm-base", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e"]

TOPOLOGIES = {
    "v2-8": "2x2",
    "v3-8": "2x2",
    "v4-8": "2x2x1",
    "v4-16": "2x2x2",
    "v4-32": "2x2x4",
    "v4-64": "2x4x4",
    "v5litepod-4": "2x2",
    "v5litepod-8": "2x4",
    "v5litepod-16": "4x4",
    "v5p-8": "2x2x1",
    "v6e-8": "2x4",
    "v6e-16": "4x4",
}
ACCELERATOR = re.compile(r"^(v2|v3|v4|v5p|v5litepod|v6e)-(\d+)$")


def default_workers(accelerator_type: str) -> int:
    """How many hosts a slice of this type has (v4-32 → 4); 1 for unknown types."""
    match = ACCELERATOR.match(accelerator_type)
    if not match:
        return 1
    family, size = match.group(1), int(match.group(2))
    if family in {"v5litepod", "v6e"}:  # size counts chips, 4 per host beyond one host
        return 1 if size <= 8 else size // 4
    return max(1, size // 8)  # size counts TensorCores, 8 per host


def accelerator_family(accelerator_type: str) -> str:
    match = ACCELERATOR.match(accelerator_type)
    return match.group(1) if match else ""

"""The portal's one door to the Cloud TPU API.

Only this package imports ``google.cloud.tpu_v2`` (and ``tpu_v2alpha1``, for attaching
disks). Everything it returns is a plain frozen record (``NodeInfo``, ``WorkerInfo``,
``DiskInfo``, ``GuestHostKeys``, ``QueuedResourceInfo``), and every failure is a
``CloudError`` that says whether retrying can help. Get the configured client with ``cloud_tpu()``.
"""

from tpus.cloud.client import CloudConfig, CloudTPU
from tpus.cloud.config import cloud_tpu
from tpus.cloud.errors import CloudError
from tpus.cloud.lifecycle import PROVISIONING, NodeRequest, QueuedResourceInfo
from tpus.cloud.records import (
    DiskInfo,
    GuestHostKeys,
    MetadataChange,
    NodeInfo,
    WorkerInfo,
    host_key_line,
)
from tpus.cloud.sshkeys import KeyLine

__all__ = [
    "CloudConfig",
    "CloudError",
    "CloudTPU",
    "DiskInfo",
    "GuestHostKeys",
    "KeyLine",
    "MetadataChange",
    "NodeInfo",
    "NodeRequest",
    "PROVISIONING",
    "QueuedResourceInfo",
    "WorkerInfo",
    "cloud_tpu",
    "host_key_line",
]

from tpus.models.audit import AuditAction, AuditEvent
from tpus.models.changes import VmChange
from tpus.models.chip_metrics import ChipSample, VmDutyDay
from tpus.models.connections import ConnectionState, VmConnection
from tpus.models.elastic import ElasticPool
from tpus.models.fair_share import FairShare
from tpus.models.grants import Grant, KindGrant, WorkerSync
from tpus.models.idle import IdleHolding
from tpus.models.inventory import DataDisk, DiskAttachment, HostKeyScan, TpuVm, Worker
from tpus.models.jobs import Job, JobState, JobWorker
from tpus.models.labs import Invite, Lab, LabKey, Membership
from tpus.models.network import ConfigFeed, IpChange, IpChangeNotice, PortForward
from tpus.models.provisioning import (
    LabAllowance,
    LabNotice,
    Provisioning,
    VmRequest,
    VmRequestState,
)
from tpus.models.snapshots import Snapshot, SnapshotBlob, SnapshotFile
from tpus.models.sync import ZoneSync
from tpus.models.usage import UsageDay

__all__ = [
    "AuditAction",
    "AuditEvent",
    "ChipSample",
    "ConfigFeed",
    "ConnectionState",
    "DataDisk",
    "DiskAttachment",
    "ElasticPool",
    "FairShare",
    "HostKeyScan",
    "IdleHolding",
    "Grant",
    "Invite",
    "KindGrant",
    "Job",
    "JobState",
    "JobWorker",
    "IpChange",
    "IpChangeNotice",
    "Lab",
    "LabAllowance",
    "LabNotice",
    "LabKey",
    "Membership",
    "PortForward",
    "Snapshot",
    "SnapshotBlob",
    "SnapshotFile",
    "Provisioning",
    "TpuVm",
    "VmChange",
    "UsageDay",
    "VmDutyDay",
    "VmConnection",
    "VmRequest",
    "VmRequestState",
    "Worker",
    "WorkerSync",
    "ZoneSync",
]

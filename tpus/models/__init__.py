from tpus.models.audit import AuditAction, AuditEvent
from tpus.models.grants import Grant, WorkerSync
from tpus.models.inventory import DataDisk, DiskAttachment, TpuVm, Worker
from tpus.models.labs import Invite, Lab, Membership
from tpus.models.network import ConfigFeed, IpChange, IpChangeNotice

__all__ = [
    "AuditAction",
    "AuditEvent",
    "ConfigFeed",
    "DataDisk",
    "DiskAttachment",
    "Grant",
    "Invite",
    "IpChange",
    "IpChangeNotice",
    "Lab",
    "Membership",
    "TpuVm",
    "Worker",
    "WorkerSync",
]

from tpus.models.audit import AuditAction, AuditEvent
from tpus.models.grants import Grant, WorkerSync
from tpus.models.inventory import DataDisk, DiskAttachment, TpuVm, Worker
from tpus.models.labs import Invite, Lab, Membership

__all__ = [
    "AuditAction",
    "AuditEvent",
    "DataDisk",
    "DiskAttachment",
    "Grant",
    "Invite",
    "Lab",
    "Membership",
    "TpuVm",
    "Worker",
    "WorkerSync",
]

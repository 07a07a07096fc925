from tpus.models.audit import AuditAction, AuditEvent
from tpus.models.inventory import DataDisk, DiskAttachment, TpuVm, Worker
from tpus.models.labs import Invite, Lab, Membership

__all__ = [
    "AuditAction",
    "AuditEvent",
    "DataDisk",
    "DiskAttachment",
    "Invite",
    "Lab",
    "Membership",
    "TpuVm",
    "Worker",
]

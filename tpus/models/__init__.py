from tpus.models.audit import AuditAction, AuditEvent
from tpus.models.labs import Invite, Lab, Membership

__all__ = ["AuditAction", "AuditEvent", "Invite", "Lab", "Membership"]

"""The site admin's read views of labs, VMs, grants and the audit log. Changes go
through the portal's own pages and services, which check and record them; the admin
only offers what is safe to do from here."""

from django.contrib import admin

from tpus.models import (
    AuditEvent,
    DataDisk,
    Grant,
    IpChange,
    KindGrant,
    Lab,
    LabKey,
    Membership,
    TpuVm,
    Worker,
)
from tpus.services import labkeys
from tpus.services.grants import revoke_access
from tpus.services.kind_grants import revoke_kind_grant


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Lab)
class LabAdmin(ReadOnly):
    list_display = [
        "name", "slug", "gcp_project_id", "grant_end_date", "uses_site_key", "created_at"
    ]  # fmt: skip
    search_fields = ["name", "slug", "gcp_project_id"]
    actions = ["use_site_key", "use_own_key"]

    @admin.action(description="Log in to this lab's workers with the site-wide SSH key")
    def use_site_key(self, request, queryset):
        if queryset.count() != 1:
            self.message_user(request, "Choose exactly one lab.", level="error")
            return
        try:
            labkeys.set_uses_site_key(request.user, queryset.get(), True, request=request)
        except labkeys.LabKeyError as exc:
            self.message_user(request, str(exc), level="error")
        else:
            self.message_user(request, "The lab now uses the site-wide SSH key.")

    @admin.action(description="Log in to these labs' workers with their own SSH keys")
    def use_own_key(self, request, queryset):
        for lab in queryset:
            labkeys.set_uses_site_key(request.user, lab, False, request=request)
        self.message_user(request, "Those labs use their own SSH keys.")


@admin.register(LabKey)
class LabKeyAdmin(ReadOnly):
    """The public half only: the private half is never shown."""

    list_display = ["lab", "fingerprint", "created_at"]
    fields = ["lab", "public_key", "fingerprint", "created_at"]
    readonly_fields = fields


@admin.register(Membership)
class MembershipAdmin(ReadOnly):
    list_display = ["user", "lab", "role", "state", "requested_at", "decided_at"]
    list_filter = ["state", "role", "lab"]
    search_fields = ["user__email", "lab__name"]
    list_select_related = ["user", "lab"]


class WorkerInline(admin.TabularInline):
    model = Worker
    fields = ["index", "external_ip", "internal_ip", "host_keys_source", "host_key_mismatch_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(TpuVm)
class TpuVmAdmin(ReadOnly):
    list_display = ["name", "lab", "zone", "accelerator_type", "state", "health", "last_seen_at"]
    list_filter = ["state", "health", "lab"]
    search_fields = ["name", "lab__name"]
    list_select_related = ["lab"]
    inlines = [WorkerInline]


@admin.register(DataDisk)
class DataDiskAdmin(ReadOnly):
    list_display = ["name", "lab", "zone", "size_gb", "mount_point"]
    list_select_related = ["lab"]


@admin.register(Grant)
class GrantAdmin(ReadOnly):
    list_display = ["user", "vm", "sudo", "expires_on", "state", "changed_at"]
    list_filter = ["state", "sudo"]
    search_fields = ["user__email", "vm__name"]
    list_select_related = ["user", "vm"]
    actions = ["revoke"]

    @admin.action(description="Revoke (keys removed, account locked, processes killed)")
    def revoke(self, request, queryset):
        for grant in queryset:
            revoke_access(request.user, grant, reason="revoked by a site admin", request=request)


@admin.register(KindGrant)
class KindGrantAdmin(ReadOnly):
    list_display = ["user", "lab", "accelerator_type", "sudo", "expires_on", "state"]
    list_filter = ["state", "sudo"]
    search_fields = ["user__email", "lab__slug", "accelerator_type"]
    list_select_related = ["user", "lab"]
    actions = ["revoke"]

    @admin.action(description="Revoke, with the VM grants it made")
    def revoke(self, request, queryset):
        for kind in queryset:
            revoke_kind_grant(request.user, kind, request=request)


@admin.register(IpChange)
class IpChangeAdmin(ReadOnly):
    list_display = ["worker", "old_ip", "new_ip", "seen_at"]
    list_select_related = ["worker__vm"]


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnly):
    list_display = ["created_at", "lab", "actor", "action", "target_user", "summary"]
    list_filter = ["action"]
    search_fields = ["summary", "actor__email", "target_user__email"]
    list_select_related = ["lab", "actor", "target_user"]

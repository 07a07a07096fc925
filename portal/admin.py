"""The outbox, for site admins: what was sent, what is waiting and why, what was
given up on. Read-only; message bodies are not shown (they may hold sign-in or reset
links meant for one person)."""

from django.contrib import admin

from portal.models import OutboxMessage


@admin.register(OutboxMessage)
class OutboxMessageAdmin(admin.ModelAdmin):
    list_display = [
        "created_at", "kind", "to", "subject", "state", "attempts", "next_attempt_at",
        "sent_at", "last_error",
    ]  # fmt: skip
    list_filter = ["state", "kind"]
    search_fields = ["to", "subject"]
    date_hierarchy = "created_at"
    ordering = ["-created_at"]
    fields = [
        "kind", "to", "from_email", "subject", "message_id", "state", "attempts",
        "next_attempt_at", "last_error", "created_at", "sent_at",
    ]  # fmt: skip
    readonly_fields = fields

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

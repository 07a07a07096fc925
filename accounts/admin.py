"""Site admin views of keys and unix accounts. Keys are added by their owners through
the checks in ``accounts.keys``, so the admin may look and delete, never type a key;
UIDs and fingerprints are never edited by hand."""

from django.contrib import admin

from accounts.keys import delete_key
from accounts.models import SSHKey, UidAllocation, UnixAccount, User
from tpus.services.access_changes import user_keys_changed


@admin.register(SSHKey)
class SSHKeyAdmin(admin.ModelAdmin):
    list_display = ["fingerprint_sha256", "user", "key_type", "bits", "label", "created_at"]
    list_filter = ["key_type"]
    search_fields = ["user__email", "fingerprint_sha256", "label", "comment"]
    list_select_related = ["user"]
    readonly_fields = [
        "user",
        "key_type",
        "blob_b64",
        "bits",
        "fingerprint_sha256",
        "comment",
        "created_at",
    ]
    fields = ["user", "label", *readonly_fields[1:]]

    def has_add_permission(self, request):
        return False

    # Deleting goes through the use case, so it is audited and the VMs follow.
    def delete_model(self, request, obj):
        delete_key(obj.user, obj, request, actor=request.user)

    def delete_queryset(self, request, queryset):
        for key in queryset.select_related("user"):
            delete_key(key.user, key, request, actor=request.user)


@admin.register(UnixAccount)
class UnixAccountAdmin(admin.ModelAdmin):
    list_display = ["username", "uid", "user", "created_at", "provisioned_at"]
    search_fields = ["username", "user__email"]
    list_select_related = ["user"]
    readonly_fields = ["user", "username", "uid", "gid", "created_at", "provisioned_at"]

    def has_add_permission(self, request):
        return False


@admin.register(UidAllocation)
class UidAllocationAdmin(admin.ModelAdmin):
    list_display = ["uid", "user", "allocated_at"]
    search_fields = ["=uid", "user__email"]
    list_select_related = ["user"]
    readonly_fields = ["uid", "user", "allocated_at"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(User)
class UserAdmin(admin.ModelAdmin):
    """Site admins find people and can deactivate them: a deactivated person cannot
    sign in, their API tokens stop working, and the next reconcile of each VM they
    use locks their account there."""

    list_display = ["email", "full_name", "is_active", "is_superuser", "date_joined", "last_login"]
    list_filter = ["is_active", "is_superuser"]
    search_fields = ["email", "full_name", "unix_account__username"]
    readonly_fields = ["email", "date_joined", "last_login"]
    fields = [
        "email",
        "full_name",
        "is_active",
        "is_staff",
        "is_superuser",
        "date_joined",
        "last_login",
    ]
    actions = ["deactivate"]

    def has_add_permission(self, request):
        return False  # people sign up themselves, with a verified email

    @admin.action(description="Deactivate, and lock their accounts on every VM")
    def deactivate(self, request, queryset):
        for user in queryset.filter(is_active=True):
            user.is_active = False
            user.save(update_fields=["is_active"])
            user_keys_changed(user)

    def save_model(self, request, obj, form, change):
        """Unticking "active" in the edit form is the same deactivation as the bulk
        action, so it asks for the same reconcile; ticking it again unlocks."""
        super().save_model(request, obj, form, change)
        if change and "is_active" in form.changed_data:
            user_keys_changed(obj)

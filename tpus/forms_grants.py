"""Forms for giving people access to TPU VMs."""

from __future__ import annotations

from django import forms
from django.utils import timezone

from tpus.models.labs import MembershipState


def _members_with_accounts(lab):
    from accounts.models import User

    return (
        User.objects.filter(
            memberships__lab=lab,
            memberships__state=MembershipState.APPROVED,
            unix_account__isnull=False,
        )
        .exclude(unix_account__username="")
        .select_related("unix_account")
        .order_by("unix_account__username")
    )


class MemberChoiceField(forms.ModelChoiceField):
    def label_from_instance(self, user):
        return f"{user.unix_account.username} ({user.email})"


class _GrantOptions(forms.Form):
    sudo = forms.BooleanField(required=False, label="sudo")
    expires_on = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), label="Until"
    )

    def __init__(self, *args, lab, **kwargs):
        super().__init__(*args, **kwargs)
        self.lab = lab
        self.fields["sudo"].initial = lab.default_sudo
        if lab.grant_end_date:
            self.fields[
                "expires_on"
            ].help_text = f"At the latest the lab's end date, {lab.grant_end_date:%d %b %Y}."

    def clean_expires_on(self):
        value = self.cleaned_data["expires_on"]
        if value and value <= timezone.localdate():
            raise forms.ValidationError("Choose a date in the future.")
        return value


class GrantForm(_GrantOptions):
    """On a VM's page: give one member access."""

    user = MemberChoiceField(queryset=None, label="Member", empty_label=None)
    field_order = ["user", "sudo", "expires_on"]

    def __init__(self, *args, lab, **kwargs):
        super().__init__(*args, lab=lab, **kwargs)
        self.fields["user"].queryset = _members_with_accounts(lab)


class MemberGrantForm(_GrantOptions):
    """On a member's row: give access to several VMs at once."""

    vms = forms.ModelMultipleChoiceField(
        queryset=None, widget=forms.CheckboxSelectMultiple, label="TPU VMs"
    )
    field_order = ["vms", "sudo", "expires_on"]

    def __init__(self, *args, lab, **kwargs):
        super().__init__(*args, lab=lab, **kwargs)
        self.fields["vms"].queryset = lab.vms.filter(missing_since=None).order_by("name")

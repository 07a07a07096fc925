"""Forms for giving people access to TPU VMs."""

from __future__ import annotations

from django import forms
from django.utils import timezone

from tpus.services import directory


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
    """On a VM's page: give one member access. The person is typed (unix username or
    email, with a search-as-you-type list to pick from) and resolved inside the lab."""

    user = forms.CharField(label="Member", max_length=254)
    field_order = ["user", "sudo", "expires_on"]

    def clean_user(self):
        try:
            return directory.resolve_grantee(self.lab, self.cleaned_data["user"])
        except directory.NoMatch as exc:
            raise forms.ValidationError(str(exc)) from None


class MemberGrantForm(_GrantOptions):
    """On a member's page: give access to one TPU VM, typed by name (with a
    search-as-you-type list to pick from) and resolved inside the lab."""

    vm = forms.CharField(label="TPU VM", max_length=63)
    field_order = ["vm", "sudo", "expires_on"]

    def clean_vm(self):
        try:
            return directory.resolve_vm(self.lab, self.cleaned_data["vm"])
        except directory.NoMatch as exc:
            raise forms.ValidationError(str(exc)) from None


class KindGrantForm(GrantForm):
    """On the lab's kind grants page: give one member every VM of an accelerator type,
    typed with the lab's types to pick from (``kinds``); the service checks the type."""

    accelerator_type = forms.CharField(label="Accelerator type", max_length=40)
    field_order = ["user", "accelerator_type", "sudo", "expires_on"]

    def __init__(self, *args, lab, kinds=(), **kwargs):
        super().__init__(*args, lab=lab, **kwargs)
        self.kinds = list(kinds)
        self.fields["accelerator_type"].widget.attrs.update(
            {"list": "lab-kinds", "placeholder": "v4-8", "autocomplete": "off"}
        )

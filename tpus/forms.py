"""Forms for lab pages. They validate shape and size; the services decide what is
allowed."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from portal.validators import validate_multiline_text, validate_plain_text
from tpus.models import Lab
from tpus.models.labs import Role, validate_zones
from tpus.services.labs import PURPOSE_MAX


class JoinForm(forms.Form):
    purpose = forms.CharField(
        max_length=PURPOSE_MAX,
        widget=forms.Textarea(attrs={"rows": 3}),
        validators=[validate_multiline_text],
        help_text="A sentence or two on the research you will run.",
    )
    accept_policy = forms.BooleanField(
        required=True,
        label="I have read the lab's usage policy and will follow it.",
        error_messages={"required": "You need to accept the lab's usage policy to join."},
    )


class AcceptInviteForm(forms.Form):
    accept_policy = JoinForm.base_fields["accept_policy"]


class RejectForm(forms.Form):
    note = forms.CharField(
        max_length=500,
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        validators=[validate_multiline_text],
        help_text="Optional; sent to the person in the email.",
    )


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class InviteForm(forms.Form):
    email = forms.EmailField(
        required=False, help_text="Leave empty for a link anyone you send it to can use once."
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class ZonesField(forms.CharField):
    """Zones typed as a comma- or space-separated list."""

    def to_python(self, value):
        text = super().to_python(value) or ""
        return [zone for zone in text.replace(",", " ").split() if zone]

    def prepare_value(self, value):
        return ", ".join(value) if isinstance(value, list) else value

    def validate(self, value):
        if self.required and not value:
            raise ValidationError(self.error_messages["required"], code="required")
        validate_zones(value)


class LabSettingsForm(forms.ModelForm):
    zones = ZonesField(
        required=False, max_length=2000, help_text="For example: us-central1-f, europe-west4-a"
    )

    class Meta:
        model = Lab
        fields = [
            "name",
            "gcp_project_id",
            "zones",
            "grant_end_date",
            "default_sudo",
            "default_agent_forwarding",
            "discoverable",
            "policy_text",
        ]
        widgets = {"grant_end_date": forms.DateInput(attrs={"type": "date"})}

    def clean_policy_text(self):
        text = self.cleaned_data["policy_text"]
        validate_multiline_text(text)
        return text


class LabCreateForm(LabSettingsForm):
    admin_emails = forms.CharField(
        max_length=2000,
        help_text="Email addresses of the lab's first admins (they need accounts).",
        validators=[validate_plain_text],
    )

    class Meta(LabSettingsForm.Meta):
        fields = ["name", "slug", *LabSettingsForm.Meta.fields[1:]]

    def clean_admin_emails(self):
        text = self.cleaned_data["admin_emails"]
        return [email for email in text.replace(",", " ").split() if email]

"""Forms for lab pages. They validate shape and size; the services decide what is
allowed."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from portal.validators import validate_multiline_text, validate_plain_text
from portal.widgets import PlainSelect
from tpus.models import Lab, Membership, TpuVm
from tpus.models.fair_share import MAX_SHARE, MIN_SHARE
from tpus.models.labs import MembershipState, Role, validate_zones
from tpus.services.labs import IDLE_EXEMPTION_FIELDS, PURPOSE_MAX, SITE_ADMIN_FIELDS


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


class ShareForm(forms.Form):
    """A person's share of the lab's pool."""

    share = forms.DecimalField(
        min_value=MIN_SHARE,
        max_value=MAX_SHARE,
        max_digits=7,
        decimal_places=2,
        help_text="1 unless set. Their waiting jobs go in the order of recent use divided by "
        "the share: with 2, they may use twice the chip-hours of someone with 1.",
    )


class InviteForm(forms.Form):
    email = forms.EmailField(
        required=False, help_text="Leave empty for a link anyone you send it to can use once."
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, widget=PlainSelect)


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
    """What a lab admin may change. The lab's GCP project and zones are not here (the
    project's TPU VMs become the lab's), nor its grant's end date (it comes from the TPU
    grant and ends everyone's access): only a site admin sets them."""

    class Meta:
        model = Lab
        fields = [
            "name",
            "default_sudo",
            "discoverable",
            "policy_text",
            "job_tasks_max",
            "job_memory_max_mb",
            "job_log_max_mb",
            "snapshot_max_mb",
            "snapshot_max_files",
            "max_chips_per_person",
            "max_waiting_jobs_per_person",
            "fair_share_half_life_days",
            "token_lifetime_days",
            "idle_policy_enabled",
            "idle_threshold_percent",
            "idle_warn_minutes",
            "idle_admins_minutes",
            "idle_release",
        ]
        widgets = {"grant_end_date": forms.DateInput(attrs={"type": "date"})}

    # Exemptions from the policy on idle chips: the lab's approved members and its VMs.
    idle_exempt_people = forms.ModelMultipleChoiceField(
        queryset=Membership.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="People the policy on idle chips leaves alone",
    )
    idle_exempt_vms = forms.ModelMultipleChoiceField(
        queryset=TpuVm.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="TPU VMs the policy on idle chips leaves alone",
    )

    # Left out (an older form, a script that predates them): the lab keeps what it has,
    # and a new lab gets the defaults.
    KEPT_WHEN_LEFT_OUT = (
        "job_tasks_max",
        "job_memory_max_mb",
        "job_log_max_mb",
        "snapshot_max_mb",
        "snapshot_max_files",
        "max_chips_per_person",
        "max_waiting_jobs_per_person",
        "fair_share_half_life_days",
        "token_lifetime_days",
        "idle_threshold_percent",
        "idle_warn_minutes",
        "idle_admins_minutes",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in self.KEPT_WHEN_LEFT_OUT:
            if name in self.fields:
                self.fields[name].required = False
        lab = self.instance if self.instance.pk else None
        if lab is None:
            for name in IDLE_EXEMPTION_FIELDS:
                self.fields.pop(name, None)
            return
        people = self.fields["idle_exempt_people"]
        people.queryset = (
            Membership.objects.filter(lab=lab, state=MembershipState.APPROVED)
            .select_related("user")
            .order_by("user__email")
        )
        people.label_from_instance = lambda m: m.user.email
        people.initial = [m.pk for m in people.queryset if m.idle_exempt]
        vms = self.fields["idle_exempt_vms"]
        vms.queryset = TpuVm.objects.filter(lab=lab, missing_since__isnull=True).order_by("name")
        vms.label_from_instance = lambda vm: f"{vm.name} ({vm.zone})"
        vms.initial = [vm.pk for vm in vms.queryset if vm.idle_exempt]

    def clean(self):
        data = super().clean()
        for name in self.KEPT_WHEN_LEFT_OUT:
            if name in self.fields and data.get(name) is None and name not in self.errors:
                data[name] = getattr(self.instance, name)
        return data

    def clean_policy_text(self):
        text = self.cleaned_data["policy_text"]
        validate_multiline_text(text)
        return text


class SiteLabSettingsForm(LabSettingsForm):
    """A site admin's settings form: everything, including the project, zones and the
    grant's end date."""

    zones = ZonesField(
        required=False, max_length=2000, help_text="For example: us-central1-f, europe-west4-a"
    )

    class Meta(LabSettingsForm.Meta):
        fields = ["name", *SITE_ADMIN_FIELDS, *LabSettingsForm.Meta.fields[1:]]


class LabCreateForm(SiteLabSettingsForm):
    admin_emails = forms.CharField(
        max_length=2000,
        help_text="Email addresses of the lab's first admins (they need accounts).",
        validators=[validate_plain_text],
    )

    class Meta(SiteLabSettingsForm.Meta):
        fields = ["name", "slug", *SiteLabSettingsForm.Meta.fields[1:]]

    def clean_admin_emails(self):
        text = self.cleaned_data["admin_emails"]
        return [email for email in text.replace(",", " ").split() if email]


def valid_filters(form: forms.Form) -> dict:
    """A list's filters from a GET form: the valid, non-empty ones. A stale value (a
    zone the lab no longer has, a made-up state) is dropped rather than refused."""
    if not form.is_bound:
        return {}
    form.is_valid()
    return {k: v for k, v in form.cleaned_data.items() if v}


class MemberFilterForm(forms.Form):
    """The admin page's member list: search, state and role."""

    q = forms.CharField(required=False, max_length=100, label="Search")
    state = forms.ChoiceField(
        required=False,
        choices=[("", "Any state"), *MembershipState.choices],
        label="State",
        widget=PlainSelect,
    )
    role = forms.ChoiceField(
        required=False,
        choices=[("", "Any role"), *Role.choices],
        label="Role",
        widget=PlainSelect,
    )

    def filters(self) -> dict:
        return valid_filters(self)

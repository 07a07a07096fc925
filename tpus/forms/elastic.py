"""The kinds page's form for a kind's elastic pool."""

from __future__ import annotations

from django import forms

from tpus.models.elastic import DEFAULT_IDLE_MINUTES
from tpus.models.provisioning import Provisioning


class ElasticPoolForm(forms.Form):
    """Switch a kind's elastic pool on (with what its VMs are made with) or off. What
    the values may be is checked by ``elastic_admin.set_pool``, which names each bad
    field."""

    accelerator_type = forms.ChoiceField(label="Kind")
    enabled = forms.BooleanField(label="on", required=False)
    provisioning = forms.ChoiceField(
        choices=[(p.value, p.label) for p in (Provisioning.SPOT, Provisioning.PREEMPTIBLE)],
        initial=Provisioning.SPOT,
    )
    zones = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple)
    runtime_version = forms.CharField(max_length=100, required=False)
    idle_minutes = forms.IntegerField(label="idle limit (min)", initial=DEFAULT_IDLE_MINUTES)
    max_vms = forms.IntegerField(label="at most (VMs, optional)", required=False)

    def __init__(self, *args, lab, kinds: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["accelerator_type"].choices = [(k, k) for k in kinds]
        self.fields["zones"].choices = [(z, z) for z in lab.zones]

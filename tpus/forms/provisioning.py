"""The form a lab admin asks for a TPU VM with."""

from __future__ import annotations

from django import forms

from tpus.models.inventory import validate_node_name
from tpus.models.provisioning import Provisioning


class VmCreateForm(forms.Form):
    name = forms.CharField(
        max_length=63,
        validators=[validate_node_name],
        help_text="The VM's name in Google Cloud and the ssh host alias people use (tpu5).",
    )
    zone = forms.ChoiceField()
    accelerator_type = forms.CharField(
        label="Accelerator type", max_length=40, help_text="As Google names it: v4-32, v5litepod-8."
    )
    runtime_version = forms.CharField(label="Runtime version", max_length=100)
    provisioning = forms.ChoiceField(
        choices=Provisioning.choices,
        initial=Provisioning.ON_DEMAND,
        widget=forms.RadioSelect,
        help_text="Spot and preemptible VMs cost less and Google may take them back at any time.",
    )
    queued = forms.BooleanField(
        required=False,
        label="Wait for capacity (a queued request)",
        help_text="Without it the VM is made now or not at all: a zone with no capacity "
        "refuses it. Queued, it waits until Google has room, within the window below.",
    )
    valid_after = forms.DateTimeField(
        required=False,
        label="Not before",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
    )
    valid_until = forms.DateTimeField(
        required=False,
        label="Give up after",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="A queued request still waiting then fails, and the lab's admins are told.",
    )
    keep_alive = forms.BooleanField(
        required=False,
        label="Keep it alive",
        help_text="When Google preempts or deletes it, ask for it again and restore "
        "everything: accounts, keys, disks, the same name in everyone's ssh config.",
    )

    def __init__(self, *args, lab, offered=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["zone"].choices = [(z, z) for z in lab.zones]
        offered = offered or {}
        types = sorted({t for zone in offered.values() for t in zone["types"]})
        versions = sorted({v for zone in offered.values() for v in zone["versions"]})
        self.fields["accelerator_type"].widget.attrs["list"] = "accelerator-types"
        self.fields["runtime_version"].widget.attrs["list"] = "runtime-versions"
        self.types, self.versions = types, versions

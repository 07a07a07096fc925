"""Forms for TPU VMs and data disks."""

from __future__ import annotations

import ipaddress

from django import forms
from django.core.exceptions import ValidationError

from portal.widgets import PlainSelect
from tpus.forms.labs import valid_filters
from tpus.models.inventory import (
    DiskMode,
    NodeState,
    validate_accelerator_type,
    validate_disk_name,
    validate_mount_point,
    validate_node_name,
)
from tpus.services.inventory import ManualWorker


def _zone_choices(lab):
    return [(zone, zone) for zone in lab.zones]


class ImportForm(forms.Form):
    nodes = forms.MultipleChoiceField(widget=forms.CheckboxSelectMultiple)

    def __init__(self, *args, candidates=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["nodes"].choices = [(c.key, c.key) for c in candidates]


class WorkersField(forms.CharField):
    """One worker per line: ``external_ip`` or ``external_ip internal_ip``."""

    widget = forms.Textarea(attrs={"rows": 4})

    def to_python(self, value):
        text = super().to_python(value) or ""
        workers = []
        for number, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) > 2:
                raise ValidationError(
                    f"Line {number}: give an external IP, then optionally an internal IP."
                )
            try:
                addresses = [str(ipaddress.ip_address(p)) for p in parts]
            except ValueError:
                raise ValidationError(
                    f"Line {number}: {line.strip()[:60]!r} is not an IP address."
                ) from None
            workers.append(
                ManualWorker(external_ip=addresses[0], internal_ip=(addresses[1:] or [None])[0])
            )
        if len(workers) > 256:
            raise ValidationError("At most 256 workers.")
        return workers


class ManualVmForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[validate_node_name])
    zone = forms.ChoiceField()
    accelerator_type = forms.CharField(max_length=40, validators=[validate_accelerator_type])
    workers = WorkersField(
        max_length=20000,
        help_text="One worker per line, in worker order: external IP, then optionally "
        "the internal IP.",
    )

    def __init__(self, *args, lab, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["zone"].choices = _zone_choices(lab)


class DiskForm(forms.Form):
    name = forms.CharField(max_length=63, validators=[validate_disk_name])
    zone = forms.ChoiceField()
    size_gb = forms.IntegerField(min_value=1, max_value=65536, required=False, label="Size (GB)")
    mount_point = forms.CharField(max_length=200, initial="/ssd", validators=[validate_mount_point])

    def __init__(self, *args, lab, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["zone"].choices = _zone_choices(lab)


class AttachForm(forms.Form):
    vm = forms.ModelChoiceField(queryset=None, label="TPU VM")
    mode = forms.ChoiceField(choices=DiskMode.choices, initial=DiskMode.READ_ONLY)

    def __init__(self, *args, disk, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["vm"].queryset = disk.lab.vms.filter(zone=disk.zone)


class VmFilterForm(forms.Form):
    """The VM list: name, zone, state and accelerator type."""

    name = forms.CharField(required=False, max_length=63, label="Name")
    zone = forms.ChoiceField(required=False, label="Zone", widget=PlainSelect)
    state = forms.ChoiceField(
        required=False,
        choices=[("", "Any state"), *NodeState.choices, ("missing", "Gone from the API")],
        label="State",
        widget=PlainSelect,
    )
    accelerator = forms.ChoiceField(required=False, label="Type", widget=PlainSelect)

    def __init__(self, *args, zones, accelerators, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["zone"].choices = [("", "Any zone"), *((z, z) for z in zones)]
        self.fields["accelerator"].choices = [("", "Any type"), *((a, a) for a in accelerators)]

    def filters(self) -> dict:
        return valid_filters(self)

"""Forms for running a job on a TPU VM and for the usage page's period."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError

from tpus.services import usage
from tpus.services.jobs import MAX_TIME_LIMIT_MINUTES, JobSpec, parse_command, parse_env

# The service's field names (clean_spec's error dict) → this form's fields.
_SERVICE_FIELDS = {
    "script": "script",
    "python": "python",
    "cwd": "cwd",
    "env": "env",
    "time_limit_minutes": "time_limit_minutes",
}


class JobForm(forms.Form):
    """A command (split like a shell would, never run by one) or a script in the home
    with its arguments, and the environment it runs in. The service checks the paths
    and words again (``clean_spec``) and maps its errors back with ``add_service_error``."""

    command = forms.CharField(
        label="Command",
        required=False,
        max_length=8192,
        widget=forms.TextInput(attrs={"placeholder": "python3 train.py --steps 1000"}),
        help_text="Split into words like a shell would (quotes work); no pipes, "
        "redirections or variables: it is not run by a shell.",
    )
    script = forms.CharField(
        label="or a script in your home",
        required=False,
        max_length=4096,
        widget=forms.TextInput(attrs={"placeholder": "train.py or ~/src/train.py"}),
        help_text="Run with the Python environment below.",
    )
    script_args = forms.CharField(
        label="Its arguments",
        required=False,
        max_length=8192,
        widget=forms.TextInput(attrs={"placeholder": "--steps 1000"}),
    )
    python = forms.CharField(
        label="Python environment",
        required=False,
        max_length=4096,
        widget=forms.TextInput(attrs={"placeholder": "~/venv"}),
        help_text="A venv in your home; empty for the VM's system Python.",
    )
    cwd = forms.CharField(
        label="Working directory",
        required=False,
        max_length=4096,
        help_text="In your home; empty for the home itself.",
    )
    env = forms.CharField(
        label="Environment variables",
        required=False,
        max_length=65536,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "XLA_FLAGS=--xla_dump_to=/tmp"}),
        help_text="One NAME=value a line.",
    )
    time_limit_minutes = forms.IntegerField(
        label="Time limit (minutes)",
        required=False,
        min_value=1,
        max_value=MAX_TIME_LIMIT_MINUTES,
        help_text="Stopped when it runs longer; empty for no limit.",
    )
    notify = forms.BooleanField(label="Email me when it ends", required=False)
    rerun_after_preemption = forms.BooleanField(
        label="Run it again after a preemption",
        required=False,
        help_text="On a spot or preemptible VM: when Google takes the VM back while this "
        "job runs, it is queued again at the head of the line and starts when the VM is back.",
    )
    use_tcmalloc = forms.BooleanField(
        label="LD_PRELOAD TCMalloc when available", required=False, initial=True
    )

    def clean(self):
        data = super().clean()
        command, script = data.get("command", "").strip(), data.get("script", "").strip()
        if command and script:
            self.add_error("command", "Give a command or a script, not both.")
        elif not command and not script and "command" not in self.errors:
            self.add_error("command", "Give the command to run, or a script.")
        elif command:
            data["args"] = self._words("command", command)
        else:
            args = data.get("script_args", "").strip()
            data["args"] = self._words("script_args", args) if args else []
        try:
            data["env_pairs"] = parse_env(data.get("env", ""))
        except ValidationError as exc:
            self.add_error("env", exc)
        return data

    def _words(self, field: str, text: str) -> list[str]:
        try:
            return parse_command(text)
        except ValidationError as exc:
            self.add_error(field, exc)
            return []

    def spec(self) -> JobSpec:
        data = self.cleaned_data
        return JobSpec(
            args=data["args"],
            script=data["script"].strip(),
            python=data["python"].strip(),
            cwd=data["cwd"].strip(),
            env=data["env_pairs"],
            time_limit_minutes=data["time_limit_minutes"],
            notify=data["notify"],
            rerun_after_preemption=data["rerun_after_preemption"],
            use_tcmalloc=data["use_tcmalloc"],
        )

    def add_service_error(self, exc: ValidationError) -> None:
        """The service's refusal on the fields it names (``args`` is the command, or
        the script's arguments), or above the form."""
        if not hasattr(exc, "error_dict"):
            self.add_error(None, exc)
            return
        for name, errors in exc.message_dict.items():
            if name == "args":
                field = "script_args" if self.cleaned_data.get("script", "").strip() else "command"
            else:
                field = _SERVICE_FIELDS.get(name)
            for message in errors:
                self.add_error(field, message)


class PeriodForm(forms.Form):
    """The usage page's days, ``from`` and ``to`` (both included, as in the query
    string ``?from=2025-06-01&to=2025-06-30``); the last 30 days by default."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        date = forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d")
        self.fields["from"] = forms.DateField(label="From", widget=date)
        self.fields["to"] = forms.DateField(label="To", widget=date)

    def clean(self):
        data = super().clean()
        first, last = data.get("from"), data.get("to")
        if first and last:
            if first > last:
                self.add_error("to", "The period ends before it begins.")
            elif (last - first).days + 1 > usage.MAX_DAYS:
                self.add_error("to", f"A period is at most {usage.MAX_DAYS} days.")
        return data

    @classmethod
    def of(cls, query) -> PeriodForm:
        """Bound to ``query`` when it names a day, else showing the last 30 days."""
        if "from" in query or "to" in query:
            return cls({"from": query.get("from", ""), "to": query.get("to", "")})
        default = usage.Period.last_days()
        return cls(initial={"from": default.first, "to": default.last})

    def period(self) -> usage.Period | None:
        """The chosen period; the last 30 days for an empty form; None when wrong."""
        if not self.is_bound:
            return usage.Period.last_days()
        if self.is_valid():
            return usage.Period(self.cleaned_data["from"], self.cleaned_data["to"])
        return None

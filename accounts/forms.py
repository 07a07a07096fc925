from django import forms
from django.core.validators import ProhibitNullCharactersValidator

from accounts.sshkeys import KeyRejected, decode_key_file
from portal.uploads import kib
from portal.validators import validate_plain_text

KEY_FILE_MAX_BYTES = 16 * 1024


class TokenForm(forms.Form):
    name = forms.CharField(
        max_length=100,
        validators=[validate_plain_text],
        help_text="Where it will be used, for example “laptop cron job”.",
    )


class RawTextField(forms.CharField):
    """Text exactly as typed. The key parser and the username rules explain a stray
    space or a NUL character better than Django's generic checks, so those are off."""

    def __init__(self, **kwargs):
        kwargs.setdefault("strip", False)
        super().__init__(**kwargs)
        self.validators = [
            v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)
        ]


class KeyForm(forms.Form):
    """A public key, pasted or as a file, with an optional label. The form only reads
    the file; every check on the key itself is ``accounts.keys.add_key``'s."""

    key_text = RawTextField(
        required=False,
        label="Public key",
        widget=forms.Textarea(
            attrs={
                "rows": 4,
                "spellcheck": "false",
                "autocomplete": "off",
                "autocapitalize": "off",
                "placeholder": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA… you@laptop",
            }
        ),
    )
    key_file = forms.FileField(required=False, label="…or choose your .pub file")
    label = forms.CharField(
        max_length=100,
        required=False,
        validators=[validate_plain_text],
        help_text="Optional, to tell your keys apart, for example “work laptop”.",
    )

    def __init__(self, *args, refused_uploads: dict[str, int] | None = None, **kwargs):
        """``refused_uploads``: files the upload handler dropped at its size limit
        (``portal.uploads.refused_uploads(request)``), by field name."""
        super().__init__(*args, **kwargs)
        self.refused_uploads = refused_uploads or {}

    def clean(self):
        data = super().clean()
        if "key_file" in self.refused_uploads:
            self.add_error("key_file", _too_large(self.refused_uploads["key_file"]))
            return data
        upload = data.get("key_file")
        if upload is None:
            return data
        if (data.get("key_text") or "").strip():
            raise forms.ValidationError("Paste a key or choose a file, not both.")
        if upload.size > KEY_FILE_MAX_BYTES:
            self.add_error("key_file", _too_large(KEY_FILE_MAX_BYTES))
            return data
        try:
            data["key_text"] = decode_key_file(upload.read())
        except KeyRejected as exc:
            self.add_error("key_file", exc.message)
        return data

    @property
    def key_came_from_file(self) -> bool:
        return bool(getattr(self, "cleaned_data", {}).get("key_file"))

    def reject(self, error: KeyRejected) -> None:
        """Show a refusal from ``add_key`` next to the field it is about. A pasted
        private key is also wiped from the form, so the page never shows it again."""
        if error.code == "private_key":
            self.data = self.data.copy()
            self.data["key_text"] = ""
        if error.code == "label":
            field = "label"
        else:
            field = "key_file" if self.key_came_from_file else "key_text"
        self.add_error(field, error.message)


def _too_large(limit: int) -> str:
    return (
        f"The file is larger than {kib(limit)}, more than any SSH public key. Choose the "
        "file that ends in .pub."
    )


class UsernameForm(forms.Form):
    username = RawTextField(
        required=False,
        label="Unix username",
        widget=forms.TextInput(
            attrs={"autocomplete": "off", "autocapitalize": "off", "spellcheck": "false"}
        ),
    )

from django import forms

from portal.validators import validate_plain_text


class TokenForm(forms.Form):
    name = forms.CharField(
        max_length=100,
        validators=[validate_plain_text],
        help_text="Where it will be used, for example “laptop cron job”.",
    )

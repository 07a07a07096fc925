import datetime as dt

from django.conf import settings
from django.db import migrations, models
from django.utils import timezone


def give_live_tokens_an_end(apps, schema_editor):
    """Tokens made before tokens expired: each gets the site's lifetime from now, so
    nobody is signed out by the upgrade and none lives forever."""
    days = getattr(settings, "PORTAL_TOKEN_LIFETIME_DAYS", 90)
    end = timezone.now() + dt.timedelta(days=days)
    ApiToken = apps.get_model("accounts", "ApiToken")
    ApiToken.objects.filter(expires_at=None).update(expires_at=end)


class Migration(migrations.Migration):
    dependencies = [("accounts", "0004_device_authorizations")]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(null=True),
        ),
        migrations.RunPython(give_live_tokens_an_end, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="apitoken",
            name="expires_at",
            field=models.DateTimeField(),
        ),
    ]

from django.db import migrations, models


def reserve_names_already_on_hosts(apps, schema_editor):
    """Accounts that already exist on hosts reserve their names for their UIDs."""
    UidAllocation = apps.get_model("accounts", "UidAllocation")
    UnixAccount = apps.get_model("accounts", "UnixAccount")
    provisioned = UnixAccount.objects.exclude(provisioned_at=None).exclude(username="")
    for uid, username in provisioned.values_list("uid", "username"):
        UidAllocation.objects.filter(uid=uid, username="").update(username=username)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0002_ssh_keys_and_unix_accounts"),
    ]

    operations = [
        migrations.AddField(
            model_name="uidallocation",
            name="username",
            field=models.CharField(blank=True, max_length=31),
        ),
        migrations.RunPython(reserve_names_already_on_hosts, migrations.RunPython.noop),
    ]

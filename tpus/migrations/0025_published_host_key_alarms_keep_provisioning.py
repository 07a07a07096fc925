from django.db import migrations, models


def mark_published_alarms(apps, schema_editor):
    """Alarms that are up because of the keys the API publishes (the key kept beside
    the alarm is one of the published ones, which contradict the pins) become
    published-only alarms: still shown to the admins, no longer stopping the worker.
    Every other alarm keeps stopping it. An alarm up is taken as already mailed."""
    from tpus.models.inventory import published_key_changes

    Worker = apps.get_model("tpus", "Worker")
    for worker in Worker.objects.filter(host_key_mismatch_at__isnull=False):
        changes = published_key_changes(worker.host_keys, worker.published_host_keys)
        published = bool(changes) and worker.presented_host_key in changes
        Worker.objects.filter(pk=worker.pk).update(
            host_key_alarm_published=published, host_key_alerted_at=worker.host_key_mismatch_at
        )


class Migration(migrations.Migration):
    dependencies = [
        ("tpus", "0024_agent_forwarding_is_each_persons_own"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="host_key_alarm_published",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="worker",
            name="host_key_alerted_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(mark_published_alarms, migrations.RunPython.noop),
    ]

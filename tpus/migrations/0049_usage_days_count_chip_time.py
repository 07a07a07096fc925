import datetime as dt
import re

from django.db import migrations, models
from django.db.models import Count

# Written out here, as ``tpus.models.inventory.chip_count`` is today, so that later
# changes to it do not change what this migration did.


def _chips(accelerator_type):
    match = re.fullmatch(r"(v[0-9]+[a-z]*?)(litepod)?-([0-9]+)", accelerator_type or "")
    if not match:
        return 1
    size = int(match[3])
    return size if match[1] + (match[2] or "") in ("v5litepod", "v5e", "v6e") else max(1, size // 2)


BATCH = 500


def chip_time_of_counted_days(apps, schema_editor):
    """Each existing row's chip-time: its worker-time × the chips per worker of its VM
    (its chips over its workers; one worker when it has none recorded)."""
    UsageDay = apps.get_model("tpus", "UsageDay")
    TpuVm = apps.get_model("tpus", "TpuVm")
    Worker = apps.get_model("tpus", "Worker")
    vm_ids = UsageDay.objects.order_by().values_list("vm_id", flat=True).distinct()
    kinds = dict(TpuVm.objects.filter(pk__in=vm_ids).values_list("pk", "accelerator_type"))
    workers = dict(
        Worker.objects.filter(vm_id__in=vm_ids)
        .order_by()
        .values("vm")
        .annotate(n=Count("pk"))
        .values_list("vm", "n")
    )
    last = 0
    while True:
        rows = list(UsageDay.objects.filter(pk__gt=last).order_by("pk")[:BATCH])
        if not rows:
            return
        for row in rows:
            per_worker = _chips(kinds.get(row.vm_id)) / max(workers.get(row.vm_id, 1), 1)
            row.chip_time = dt.timedelta(
                microseconds=round(row.worker_time / dt.timedelta(microseconds=1) * per_worker)
            )
        UsageDay.objects.bulk_update(rows, ["chip_time"])
        last = rows[-1].pk


class Migration(migrations.Migration):
    dependencies = [
        ("tpus", "0048_vm_duty_days"),
    ]

    operations = [
        migrations.AddField(
            model_name="usageday",
            name="chip_time",
            field=models.DurationField(default=dt.timedelta),
        ),
        migrations.RunPython(chip_time_of_counted_days, migrations.RunPython.noop),
    ]

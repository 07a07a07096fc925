"""Add every ended job not counted yet to the per-day usage rows (the job poll does
this 500 at a time); ``--recount`` makes the rows again from every job, after
TIME_ZONE changed."""

from django.core.management.base import BaseCommand

from tpus.services import usage


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser):
        parser.add_argument(
            "--recount", action="store_true", help="make every row again from the jobs"
        )

    def handle(self, *args, recount: bool = False, **options):
        counted = usage.recount_all() if recount else usage.count_all_ended_jobs()
        self.stdout.write(f"{counted} job(s) counted into the per-day usage rows.")

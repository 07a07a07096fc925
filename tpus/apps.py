from django.apps import AppConfig


class TpusConfig(AppConfig):
    name = "tpus"
    verbose_name = "Labs and TPU VMs"

    def ready(self):
        # Register the Celery tasks once, at start-up, in every process: tpus.queue
        # finds them by name from its first call on, in any thread, without asking
        # Celery to import them (which would run django.setup() again and reset
        # logging).
        from django.contrib.auth import get_user_model
        from django.db.models.signals import pre_delete

        from portal import mail
        from tpus import (
            checks,  # noqa: F401  (registers the system checks)
            tasks,  # noqa: F401
        )
        from tpus.services import elastic_pass, emails, jobs, snapshots

        # Emails written at their first attempt, from what is true then.
        mail.register("access_active", emails.access_active_context)

        # A pool job no free VM took grows its kind's elastic pool in its submit.
        jobs.no_vm_took.connect(elastic_pass.no_vm_took, dispatch_uid="tpus.elastic.no_vm_took")
        pre_delete.connect(
            snapshots.person_deleted,
            sender=get_user_model(),
            dispatch_uid="tpus.snapshots.person_deleted",
        )

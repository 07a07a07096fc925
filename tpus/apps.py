from django.apps import AppConfig


class TpusConfig(AppConfig):
    name = "tpus"
    verbose_name = "Labs and TPU VMs"

    def ready(self):
        from tpus import checks  # noqa: F401  (registers the system checks)

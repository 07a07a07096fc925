from django.apps import AppConfig


class TpusConfig(AppConfig):
    name = "tpus"
    verbose_name = "Labs and TPU VMs"

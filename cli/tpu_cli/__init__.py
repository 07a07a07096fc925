"""tpu: the TPU Portal's command-line client. It talks only to the portal's token API
and to the person's own ``ssh`` and ``rsync``."""

__version__ = "0.1.0"

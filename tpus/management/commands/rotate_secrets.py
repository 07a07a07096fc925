"""Encrypt every secret the portal keeps in its database again with the current
PORTAL_SECRETS_KEY. Run it after moving the old key to PORTAL_SECRETS_OLD_KEYS; once it
has run, the old key can be dropped."""

from django.core.management.base import BaseCommand, CommandError

from portal.secrets import SecretUnreadable
from tpus.services.labkeys import reencrypt_all


class Command(BaseCommand):
    help = "Re-encrypt the labs' SSH private keys with the current PORTAL_SECRETS_KEY."

    def handle(self, *args, **options):
        try:
            count = reencrypt_all()
        except SecretUnreadable as exc:
            raise CommandError(
                f"{exc}. List the key they were encrypted with in PORTAL_SECRETS_OLD_KEYS."
            ) from None
        self.stdout.write(f"Re-encrypted {count} lab key(s) with the current key.")

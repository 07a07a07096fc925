"""Create the first site admin without prompts (for the quick start and deployments).

The email and password come from PORTAL_ADMIN_EMAIL and PORTAL_ADMIN_PASSWORD (or
PORTAL_ADMIN_PASSWORD_FILE). Without a password, one is generated, kept in
``var/site-admin-password`` (mode 600) and printed, so the login stays the same
across restarts; a password given in the environment is never printed. An existing
admin is left as it is.
"""

import secrets

from allauth.account.models import EmailAddress
from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

from accounts.models import User
from portal import env


class Command(BaseCommand):
    help = "Create the first site admin if there is none, and print how to sign in."

    def handle(self, *args, **options):
        email = env.string("PORTAL_ADMIN_EMAIL", "admin@localhost.localdomain").lower()
        chosen = env.secret("PORTAL_ADMIN_PASSWORD", "")
        password = chosen
        stored = settings.VAR_DIR / "site-admin-password"
        with transaction.atomic():
            user = User.objects.filter(email__iexact=email).first()
            if user is None:
                if not password:
                    password = secrets.token_urlsafe(12)
                    settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
                    stored.write_text(password + "\n")
                    stored.chmod(0o600)
                user = User.objects.create_superuser(email=email, password=password)
                EmailAddress.objects.get_or_create(
                    user=user, email=email, defaults={"verified": True, "primary": True}
                )
                self.stdout.write(f"Created site admin {email}.")
        if chosen:
            # The operator chose it: never echo a chosen password into a service's log.
            shown = "(the password in PORTAL_ADMIN_PASSWORD)"
        elif stored.exists():
            shown = stored.read_text().strip()
        else:
            shown = "(the password you set earlier)"
        self.stdout.write(f"Site admin login: {email} / {shown}")

"""Set up a demo lab on a running emulator and test fleet (see ``bin/demo``): the
fleet's hosts become the workers of an emulated 4-worker pod "tpu5", the lab imports
it, and the site admin runs the lab."""

import json
import subprocess
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from accounts.models import User
from tpus.emulator.controls import Controls
from tpus.models import Lab, Membership
from tpus.models.labs import MembershipState, Role
from tpus.services import inventory

PROJECT, ZONE = "demo-lab-1", "us-central1-f"


class Command(BaseCommand):
    help = "Create the demo lab and import the fleet-backed TPU VM tpu5."

    def add_arguments(self, parser):
        parser.add_argument("--state", required=True, help="the emulator's state file")
        parser.add_argument("--slot", type=int, default=0, help="the test fleet's slot")

    def handle(self, *args, state, slot, **options):
        status = json.loads(self._fleet(slot, "status"))
        hosts = sorted(status, key=lambda h: int(h["name"].lstrip("h")))
        if len(hosts) < 4:
            raise CommandError("start the fleet first: python -m testfleet up 4")
        hosts = hosts[:4]
        keys = {
            i: {
                line.split()[0]: line
                for line in self._fleet(slot, "host-keys", h["name"]).split("\n")
                if line
            }
            for i, h in enumerate(hosts)
        }
        controls = Controls(state)
        if not any(n.endswith("/tpu5") for n in controls.show().get("nodes", {})):
            controls.add_node(
                PROJECT, ZONE, "tpu5", accelerator_type="v4-32", workers=4,
                external_ips=[h["ip"] for h in hosts], host_keys=keys,
            )  # fmt: skip
            controls.add_disk(PROJECT, ZONE, "imagenet")
        admin = User.objects.filter(is_superuser=True).order_by("pk").first()
        if admin is None:
            raise CommandError("create the site admin first (manage.py ensure_site_admin)")
        with transaction.atomic():
            lab, _ = Lab.objects.get_or_create(
                slug="demo",
                defaults={"name": "Demo Lab", "gcp_project_id": PROJECT, "zones": [ZONE]},
            )
            Membership.objects.get_or_create(
                user=admin, lab=lab,
                defaults={
                    "role": Role.ADMIN, "state": MembershipState.APPROVED,
                    "policy_version_accepted": lab.policy_version,
                    "policy_accepted_at": timezone.now(),
                },
            )  # fmt: skip
        inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
        self.stdout.write(f"Demo Lab is ready: tpu5 = {', '.join(h['ip'] for h in hosts)}")

    def _fleet(self, slot, *args) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "testfleet", "--slot", str(slot), *args],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return result.stdout

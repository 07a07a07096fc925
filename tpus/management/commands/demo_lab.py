"""Set up a demo lab on a running emulator and test fleet (see ``bin/demo``): the
fleet's hosts become the workers of an emulated 4-worker pod "tpu5", the lab imports
it, and the site admin runs the lab. ``set_up_demo`` does it for any fleet and
emulator (tests pass their own) and returns the steps to print.

Each worker's ``/etc/skel`` holds ``venv``, a link to the shared JAX environment that
``bin/setup test`` installs (``/opt/tpu-portal-test-jax``, CPU only), so everyone who
is given access finds ``~/venv`` with jax and jaxlib in the home the portal makes."""

import os
import secrets
from pathlib import Path

from allauth.account.models import EmailAddress
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.utils import timezone

from accounts.keys import add_key
from accounts.models import User
from accounts.unix import choose_username
from testfleet.fleet import Fleet
from testfleet.hostfs import write_keypair
from testfleet.slots import SlotBusy
from tpus.emulator.controls import Controls
from tpus.models import ConnectionState, Grant, Lab, Membership, VmConnection
from tpus.models.grants import WANTED_STATES, GrantState
from tpus.models.labs import MembershipState, Role
from tpus.services import connect, inventory
from tpus.services.labkeys import lab_key

PROJECT, ZONE = "demo-lab-1", "us-central1-f"
MILO_EMAIL = "milo@demo.example"
# The job step 4 has milo paste: one psum over every worker's devices, through
# jax.distributed with what the portal hands each worker (docs/jobs.md).
DEMO_JOB = (
    'python -c "import os, jax; jax.distributed.initialize('
    "os.environ['TPU_PORTAL_COORDINATOR'], int(os.environ['TPU_PORTAL_NUM_PROCESSES']), "
    "int(os.environ['TPU_PORTAL_PROCESS_ID'])); "
    "total = jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')"
    "(jax.numpy.ones(jax.local_device_count())); "
    "print('worker', jax.process_index(), 'of', jax.process_count(), "
    "'psum over', jax.device_count(), 'devices =', float(total[0]))\""
)


class Command(BaseCommand):
    help = "Create the demo lab and import the fleet-backed TPU VM tpu5."

    def add_arguments(self, parser):
        parser.add_argument("--state", required=True, help="the emulator's state file")
        parser.add_argument("--slot", type=int, default=0, help="the test fleet's slot")

    def handle(self, *args, state, slot, **options):
        try:
            fleet = Fleet.open(slot)
        except SlotBusy as exc:
            raise CommandError(str(exc)) from None
        with fleet:
            self.stdout.write(set_up_demo(fleet, Controls(state)))


def set_up_demo(fleet: Fleet, controls: Controls) -> str:
    """The fleet's first four hosts as tpu5's workers, the Demo Lab that imports it,
    and milo ready to be added; returns what the person trying it does next."""
    hosts = sorted(fleet.hosts.values(), key=lambda h: h.index)
    if len(hosts) < 4:
        raise CommandError("start the fleet first: python -m testfleet up 4")
    hosts = hosts[:4]
    keys = {
        i: {line.split()[0]: line for line in fleet.host_keys(h.name)} for i, h in enumerate(hosts)
    }
    # A fleet host has one address, so it is each worker's internal address too: that
    # is where a pod job's workers find worker 0's jax.distributed coordinator.
    ips = [h.ip for h in hosts]
    if not any(n.endswith("/tpu5") for n in controls.show().get("nodes", {})):
        controls.add_node(
            PROJECT, ZONE, "tpu5", accelerator_type="v4-32", workers=4,
            internal_ips=ips, external_ips=ips, host_keys=keys,
        )  # fmt: skip
        controls.add_disk(PROJECT, ZONE, "imagenet")
    else:
        # An earlier run's node: it publishes what the fleet has now, as Google does.
        for index, ip in enumerate(ips):
            controls.set_ip("tpu5", index, ip)
            controls.set_ip("tpu5", index, ip, internal=True)
            for key_type, line in keys[index].items():
                controls.set_host_key("tpu5", index, key_type, line)
    jax_env = os.environ.get("TPU_PORTAL_TEST_JAX_ENV", "/opt/tpu-portal-test-jax")
    for host in hosts:
        fleet.exec(host.name, ["ln", "-sfn", jax_env, "/etc/skel/venv"])
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
    # The lab's own key on every worker, as connecting the VM does on Google's side.
    line = lab_key(lab).public_line
    for host in hosts:
        fleet.set_ssh_keys(host.name, {settings.PORTAL_LAB_SSH_USER: [line]})
    [vm] = inventory.import_vms(admin, lab, [f"{ZONE}/tpu5"])
    repinned = _repin_a_rebuilt_fleet(admin, vm, keys)
    # Connect it as an admin would: the key goes into the node's ssh-keys metadata and
    # the portal's worker checks that every worker accepts it (the page then says so).
    if not VmConnection.objects.filter(vm=vm, state=ConnectionState.CONNECTED).exists():
        connect.connect_vm(admin, vm)
    milo, milo_password, milo_key = _milo(lab)
    site, name = settings.SITE_URL, milo.unix_account.username
    notes = []
    if repinned:
        notes.append(
            f"Note: the test fleet was built anew since the last run (its sshd hosts have new"
            f" host keys), so {', '.join(repinned)} {'was' if len(repinned) == 1 else 'were'}"
            " re-pinned to them: download known_hosts again (step 2) before you ssh."
        )
    if not (Path(jax_env) / "bin" / "python").exists():
        notes.append(
            f"Note: there is no JAX in {jax_env} (bin/setup test installs it), so the job"
            " of step 4 will be refused by its pre-flight."
        )
    access_url = f"{site}/labs/{lab.slug}/vms/{vm.pk}/access/"
    grant = Grant.objects.filter(user=milo, vm=vm, state__in=WANTED_STATES).first()
    if grant is None:
        step1 = (
            f"Open {access_url} and sign in as the site admin (the login above); under"
            f' "Give access", type {name} in "Member" and click "Add to {vm.name}": each'
            f' worker\'s progress shows live until "{name} can now use {vm.name}."'
        )
    else:
        # A restarted demo: milo was added in an earlier run (or is being added now).
        state = {GrantState.ACTIVE: "has had", GrantState.PENDING: "is being given"}.get(
            grant.state, "was given (it failed; Retry is on the page)"
        )
        step1 = (
            f"{name} {state} access to {vm.name} since an earlier run of the demo: open"
            f" {access_url} and sign in as the site admin (the login above) to see it under"
            f' "Who has access" (to try "Add to {vm.name}" again, click "Revoke" there first).'
        )
    # Every name in quotes is on the page where the step happens, word for word.
    return (
        f"Demo Lab is ready: {vm.name} = {', '.join(h.ip for h in hosts)}\n"
        + "".join(f"{note}\n" for note in notes)
        + f"Collaborator login: {MILO_EMAIL} / {milo_password} (his SSH key: {milo_key})\n"
        f"1. {step1}\n"
        f'2. Click "Sign out", open {site}/ssh/ and sign in as {name} (the collaborator'
        ' login above); click "Download config" and "Download known_hosts", then paste'
        " the commands under them into a terminal: they put both files in ~/.ssh.\n"
        f"3. Then: ssh -i {milo_key} {vm.name}\n"
        f"4. Run a job: as {name}, open {site}/labs/{lab.slug}/vms/{vm.pk}/, paste the line"
        f' below into "Command", type ~/venv in "Python environment" and click'
        f" \"Queue on {vm.name}\": the job's page shows every worker's log, each ending"
        f' with "psum over {len(hosts)} devices = {len(hosts)}.0".\n'
        f"{DEMO_JOB}"
    )


def _repin_a_rebuilt_fleet(admin, vm, keys: dict[int, dict[str, str]]) -> list[str]:
    """Pin the fleet's host keys on workers pinned to other ones, and name them: a
    fleet built anew (after the machine restarted) has new sshd hosts behind the same
    addresses, as a re-created TPU VM has. The demo's own fleet, stopped and started
    by bin/demo, keeps its keys and needs none of this."""
    repinned = []
    for worker in vm.workers.order_by("index"):
        lines = sorted(keys[worker.index].values())
        if worker.host_keys and sorted(worker.host_keys) != lines:
            inventory.repin_host_keys(admin, worker, lines)
            repinned.append(worker.alias)
    return repinned


def _milo(lab) -> tuple[User, str, Path]:
    """A collaborator who signed up, verified his email, uploaded a key, chose the
    username milo and was approved: the next step is the admin's "Add". His login
    and key stay the same across runs (kept in var/demo)."""
    demo_dir = settings.VAR_DIR / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    password_file, key = demo_dir / "milo-password", demo_dir / "id_milo"
    if not password_file.exists():
        password_file.write_text(secrets.token_urlsafe(12) + "\n")
        password_file.chmod(0o600)
    password = password_file.read_text().strip()
    if not key.exists():
        write_keypair(key, "ed25519", "milo@laptop")
    with transaction.atomic():
        milo = User.objects.filter(email__iexact=MILO_EMAIL).first()
        if milo is None:
            milo = User.objects.create_user(
                email=MILO_EMAIL, password=password, full_name="Milo Demo"
            )
            EmailAddress.objects.create(user=milo, email=MILO_EMAIL, verified=True, primary=True)
        Membership.objects.get_or_create(
            user=milo, lab=lab,
            defaults={
                "role": Role.MEMBER, "state": MembershipState.APPROVED,
                "purpose": "Trying the portal.", "decided_at": timezone.now(),
                "policy_version_accepted": lab.policy_version,
                "policy_accepted_at": timezone.now(),
            },
        )  # fmt: skip
    if not milo.ssh_keys.exists():
        add_key(milo, key.with_name(key.name + ".pub").read_text(), label="laptop")
    account = getattr(User.objects.get(pk=milo.pk), "unix_account", None)
    if account is None or not account.username:
        choose_username(milo, "milo")
    return User.objects.select_related("unix_account").get(pk=milo.pk), password, key

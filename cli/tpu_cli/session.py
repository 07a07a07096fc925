"""What every command shares: the sign-in, the API, messages on stderr, the ssh files
kept current, and the jobs this machine submitted (to find a job by its number)."""

from __future__ import annotations

import json
import threading

from rich.console import Console

from tpu_cli import credentials, paths, sshfiles, vms
from tpu_cli.api import Api
from tpu_cli.errors import NOT_FOUND, ApiError, CliError

err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def say(message: str) -> None:
    err.print(message, markup=False)


class Session:
    def __init__(self):
        self.sign_in = credentials.need()
        self.api = Api(self.sign_in.url, self.sign_in.token)
        self._vms: list[vms.Vm] | None = None

    def refresh_ssh(self, *, quiet: bool = True) -> sshfiles.Refreshed:
        """The ssh config and known_hosts as the portal has them now; says so when an
        address or host key changed."""
        done = sshfiles.refresh(self.api)
        if done.changed and quiet:
            say(
                f"Updated your ssh config from {self.sign_in.url} (an address or host key changed)."
            )
        return done

    def vms(self, *, refresh: bool = True) -> list[vms.Vm]:
        if self._vms is None:
            if not refresh:
                self._vms = vms.my_vms(self.api)
                return self._vms
            # The ssh files are fetched while the VMs are asked about.
            failed: list = []

            def refresh_files() -> None:
                try:
                    self.refresh_ssh()
                except BaseException as exc:  # raised again in this thread
                    failed.append(exc)

            worker = threading.Thread(target=refresh_files, daemon=True)
            worker.start()

            def joined() -> None:
                worker.join()
                if failed:
                    raise failed[0]

            self._vms = vms.my_vms(self.api, before_match=joined)
        return self._vms

    def ssh_vm(self, name: str) -> vms.Vm:
        """A VM named on the command line, from the ssh config made current first:
        what needs only ssh asks the portal for nothing else."""
        self.refresh_ssh()
        return vms.resolve(vms.from_config(sshfiles.read_config()), name)

    def vm(self, name: str, *, need_active: bool = True) -> vms.Vm:
        return vms.resolve(self.vms(), name, need_active=need_active)

    # --- jobs by number -----------------------------------------------------------------

    def remember_job(self, job: dict, vm: vms.Vm) -> None:
        known = _read_jobs()
        known[str(job["id"])] = {"url": self.sign_in.url, "lab": vm.lab, "vm_id": vm.id}
        if len(known) > 500:
            known = dict(list(known.items())[-500:])
        paths.private_dir(paths.config_dir())
        paths.write_private(_jobs_file(), json.dumps(known) + "\n")

    def find_job(self, number: str) -> tuple:
        """(vm, job) for a job number: from the jobs this machine submitted, else by
        asking each of the person's VMs."""
        if not number.isdigit():
            raise CliError(f"A job is named by its number, such as 42, not {number!r}.", 2)
        seen = _read_jobs().get(number)
        candidates = self.vms()
        if seen and seen.get("url") == self.sign_in.url:
            first = [v for v in candidates if v.id == seen["vm_id"] and v.lab == seen["lab"]]
            candidates = first + [v for v in candidates if v not in first]
        for vm in candidates:
            try:
                return vm, self.api.get(f"{vm.api_path}/jobs/{number}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
        raise CliError(f"No job {number} on any TPU VM you can use.", NOT_FOUND)


def _jobs_file():
    return paths.config_dir() / "jobs.json"


def _read_jobs() -> dict[str, dict]:
    try:
        return json.loads(_jobs_file().read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}

"""What every command shares: the sign-in, the API, messages on stderr, the ssh files
kept current, and finding a job by its number."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console

from tpu_cli import credentials, sshfiles, vms
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

    def vms(self, *, refresh: bool = True, now: bool = False) -> list[vms.Vm]:
        """The person's VMs (``vms.my_vms``), asked for once a command; with ``refresh``
        the ssh files are made current at the same time."""
        if self._vms is None:
            self._vms = self._with_refresh(
                lambda joined: vms.my_vms(self.api, before_match=joined, now=now), refresh
            )
        return self._vms

    def _with_refresh(self, ask, refresh: bool = True):
        """``ask(joined)`` while the ssh files are fetched in another thread; ``joined``
        waits for them (and raises what the fetch raised)."""
        if not refresh:
            return ask(lambda: None)
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

        try:
            return ask(joined)
        finally:
            worker.join()

    def ssh_vm(self, name: str) -> vms.Vm:
        """A VM named on the command line, from the ssh config made current first:
        what needs only ssh asks the portal for nothing else."""
        self.refresh_ssh()
        return vms.resolve(vms.from_config(sshfiles.read_config()), name)

    def vm(self, name: str, *, need_active: bool = True) -> vms.Vm:
        return vms.resolve(self.vms(), name, need_active=need_active)

    # --- jobs by number -----------------------------------------------------------------

    def find_job(self, number: str) -> tuple:
        """(vm, job) for a job number: the person's own job from ``/me/jobs``, asked
        while their VMs are; else (a lab admin's look at someone else's job) by asking
        each of their VMs."""
        if not number.isdigit():
            raise CliError(f"A job is named by its number, such as 42, not {number!r}.", 2)
        with ThreadPoolExecutor(max_workers=1) as pool:
            asked = pool.submit(self.api.get, f"/me/jobs/{number}")
            candidates = self.vms()
            try:
                job = asked.result()
            except ApiError as exc:
                if exc.status != 404:
                    raise
                job = None
        if job is not None:
            for vm in candidates:
                if vm.id == job["vm_id"] and vm.lab == job["lab"]:
                    return vm, job
        for vm in candidates:
            if job is not None and vm.id == job["vm_id"]:
                continue
            try:
                return vm, self.api.get(f"{vm.api_path}/jobs/{number}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
        raise CliError(f"No job {number} on any TPU VM you can use.", NOT_FOUND)

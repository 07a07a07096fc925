"""The sign-in: the portal's address, the token and whose it is, in
``<config dir>/credentials.json`` (0600, in a 0700 folder)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tpu_cli import paths
from tpu_cli.errors import SIGNED_OUT, CliError


@dataclass
class SignIn:
    url: str
    token: str
    email: str


def _file() -> Path:
    return paths.config_dir() / "credentials.json"


def load() -> SignIn | None:
    try:
        data = json.loads(_file().read_text(encoding="utf-8"))
        return SignIn(url=data["url"], token=data["token"], email=data.get("email", ""))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise CliError(
            f"{_file()} is not a sign-in this client wrote; run `tpu login` again.", SIGNED_OUT
        ) from None


def need() -> SignIn:
    found = load()
    if found is None:
        raise CliError("You are not signed in; run `tpu login URL` first.", SIGNED_OUT)
    return found


def save(sign_in: SignIn) -> Path:
    folder = paths.private_dir(paths.config_dir())
    path = folder / "credentials.json"
    paths.write_private(path, json.dumps(asdict(sign_in), indent=2) + "\n")
    return path


def forget() -> bool:
    """Delete the sign-in; False when there was none."""
    try:
        os.unlink(_file())
    except FileNotFoundError:
        return False
    return True

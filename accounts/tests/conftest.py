"""Fixtures for the key and username tests: the real ``ssh-keygen``, keys it makes,
and a way to ask it for a fingerprint."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.requirements import need

# Type and size of every key the fingerprint tests make with the real ssh-keygen.
GENERATED = [
    ("ed25519", None),
    ("ecdsa", 256),
    ("ecdsa", 384),
    ("ecdsa", 521),
    ("rsa", 2048),
    ("rsa", 3072),
    ("rsa", 4096),
]


def _run_keygen(*args: str) -> str:
    result = subprocess.run(
        ["ssh-keygen", *args], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout


@pytest.fixture(scope="session")
def keygen_dir(tmp_path_factory) -> Path:
    need(shutil.which("ssh-keygen") is not None, "ssh-keygen (openssh-client) is not installed")
    return tmp_path_factory.mktemp("ssh-keygen")


@pytest.fixture(scope="session")
def generated_keys(keygen_dir) -> dict[str, Path]:
    """Fresh key pairs made by ssh-keygen, once per run: name → path of the .pub file."""
    keys = {}
    for key_type, bits in GENERATED:
        name = f"{key_type}-{bits}" if bits else key_type
        path = keygen_dir / name
        size = ["-b", str(bits)] if bits else []
        _run_keygen("-q", "-t", key_type, *size, "-N", "", "-C", f"{name}@tests", "-f", str(path))
        keys[name] = path.with_name(name + ".pub")
    return keys


@pytest.fixture
def keygen_fingerprint(keygen_dir, tmp_path) -> Callable[[str], str]:
    """The SHA256 fingerprint ssh-keygen -lf prints for a public key line."""

    def fingerprint(text: str) -> str:
        path = tmp_path / "key.pub"
        path.write_text(text + "\n")
        return _run_keygen("-lf", str(path)).split()[1]

    return fingerprint


@pytest.fixture
def keygen_rfc4716(keygen_dir, tmp_path) -> Callable[[str], str]:
    """A public key line converted to RFC 4716 by ssh-keygen -e."""

    def convert(text: str) -> str:
        path = tmp_path / "to-convert.pub"
        path.write_text(text + "\n")
        return _run_keygen("-e", "-f", str(path))

    return convert


@pytest.fixture
def make_private_key(keygen_dir, tmp_path) -> Callable[..., str]:
    """A throwaway private key made by ssh-keygen in a temporary directory, returned
    as the text someone might paste. ``fmt`` is ssh-keygen's -m (RFC4716 is its
    name for the OpenSSH format, PEM, PKCS8)."""

    def make(key_type: str = "ed25519", fmt: str = "RFC4716", passphrase: str = "") -> str:
        path = tmp_path / f"private-{key_type}-{fmt}-{len(passphrase)}"
        args = ["-q", "-t", key_type, "-m", fmt, "-N", passphrase, "-f", str(path)]
        if key_type == "rsa":
            args += ["-b", "2048"]
        _run_keygen(*args)
        return path.read_text()

    return make

"""Fixtures for the key and username tests: the real ``ssh-keygen``, keys it makes,
and a way to ask it for a fingerprint."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from accounts.tests.keystore import KeyStore, run_keygen, shared_folder
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


@pytest.fixture(scope="session")
def keygen_dir(tmp_path_factory) -> Path:
    need(shutil.which("ssh-keygen") is not None, "ssh-keygen (openssh-client) is not installed")
    return tmp_path_factory.mktemp("ssh-keygen")


@pytest.fixture(scope="session")
def key_store(keygen_dir, tmp_path_factory) -> KeyStore:
    """Key pairs made by ssh-keygen once per run, shared by the run's test processes."""
    return KeyStore(shared_folder(tmp_path_factory))


@pytest.fixture(scope="session")
def generated_keys(key_store) -> dict[str, Path]:
    """Fresh key pairs made by ssh-keygen, once per run: name → path of the .pub file."""
    keys = {}
    for key_type, bits in GENERATED:
        name = f"{key_type}-{bits}" if bits else key_type
        size = ["-b", str(bits)] if bits else []
        args = ["-t", key_type, *size, "-N", "", "-C", f"{name}@tests"]
        keys[name] = key_store.path(name, *args).with_name(name + ".pub")
    return keys


@pytest.fixture
def keygen_fingerprint(keygen_dir, tmp_path) -> Callable[[str], str]:
    """The SHA256 fingerprint ssh-keygen -lf prints for a public key line."""

    def fingerprint(text: str) -> str:
        path = tmp_path / "key.pub"
        path.write_text(text + "\n")
        return run_keygen("-lf", str(path)).split()[1]

    return fingerprint


@pytest.fixture
def keygen_rfc4716(keygen_dir, tmp_path) -> Callable[[str], str]:
    """A public key line converted to RFC 4716 by ssh-keygen -e."""

    def convert(text: str) -> str:
        path = tmp_path / "to-convert.pub"
        path.write_text(text + "\n")
        return run_keygen("-e", "-f", str(path))

    return convert


@pytest.fixture
def make_private_key(key_store) -> Callable[..., str]:
    """A throwaway private key made by ssh-keygen (once per run for each kind), returned
    as the text someone might paste. ``fmt`` is ssh-keygen's -m (RFC4716 is its
    name for the OpenSSH format, PEM, PKCS8)."""

    def make(key_type: str = "ed25519", fmt: str = "RFC4716", passphrase: str = "") -> str:
        return key_store.private_key(key_type, fmt, passphrase)

    return make

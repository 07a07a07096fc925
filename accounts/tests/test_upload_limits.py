"""Uploads are refused at a size limit before they are read whole: nothing beyond the
limit reaches memory or a temporary file, and the person is told the limit."""

from __future__ import annotations

import os

import pytest
from django.urls import reverse

from accounts.models import SSHKey
from accounts.tests import keydata

BOUNDARY = "portalboundary"
MiB = 1024 * 1024


class StreamedBody:
    """A multipart body with a key file of ``file_size`` bytes, produced as it is read
    (never held in memory), that records the most bytes ever sitting in ``temp_dir``."""

    def __init__(self, file_size: int, temp_dir, *, part_length: bool = False):
        head = (
            f"--{BOUNDARY}\r\n"
            'Content-Disposition: form-data; name="key_text"\r\n\r\n\r\n'
            f"--{BOUNDARY}\r\n"
            'Content-Disposition: form-data; name="key_file"; filename="id_ed25519.pub"\r\n'
            "Content-Type: application/octet-stream\r\n"
            + (f"Content-Length: {file_size}\r\n" if part_length else "")
            + "\r\n"
        ).encode()
        tail = (
            f"\r\n--{BOUNDARY}\r\n"
            'Content-Disposition: form-data; name="label"\r\n\r\nlaptop\r\n'
            f"--{BOUNDARY}--\r\n"
        ).encode()
        self._parts = [head, file_size, tail]  # an int is that many filler bytes
        self.length = len(head) + file_size + len(tail)
        self.temp_dir = temp_dir
        self.bytes_read = 0
        self.most_on_disk = 0

    def read(self, size: int = -1) -> bytes:
        self.most_on_disk = max(self.most_on_disk, _bytes_in(self.temp_dir))
        if size is None or size < 0:
            size = self.length - self.bytes_read
        out = bytearray()
        while self._parts and len(out) < size:
            part = self._parts[0]
            want = size - len(out)
            if isinstance(part, int):
                n = min(part, want)
                out += b"A" * n
                self._parts[0] = part - n
                if self._parts[0] == 0:
                    self._parts.pop(0)
            else:
                out += part[:want]
                if len(part) > want:
                    self._parts[0] = part[want:]
                else:
                    self._parts.pop(0)
        self.bytes_read += len(out)
        return bytes(out)

    def readline(self, size: int = -1) -> bytes:  # WSGI asks for it; multipart does not
        return self.read(size)


def _bytes_in(directory) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())


@pytest.fixture
def temp_dir(settings, tmp_path):
    """Where Django writes uploads too big for memory; small so any real one lands here."""
    directory = tmp_path / "uploads"
    directory.mkdir()
    settings.FILE_UPLOAD_TEMP_DIR = str(directory)
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 16 * 1024
    return directory


@pytest.fixture
def milo(client, make_user):
    user = make_user("milo@uni.example")
    client.force_login(user)
    return user


def _post(client, body: StreamedBody):
    return client.generic(
        "POST",
        reverse("key_list"),
        CONTENT_TYPE=f"multipart/form-data; boundary={BOUNDARY}",
        CONTENT_LENGTH=str(body.length),
        **{"wsgi.input": body},
    )


def test_a_300_mib_key_file_is_refused_before_a_byte_is_read(client, milo, temp_dir):
    body = StreamedBody(300 * MiB, temp_dir)
    response = _post(client, body)
    assert response.status_code == 400
    assert "larger than the portal accepts" in response.content.decode()
    assert body.bytes_read == 0
    assert body.most_on_disk == 0
    assert not SSHKey.objects.exists()


def test_a_key_file_over_the_limit_is_dropped_as_it_arrives_with_a_form_error(
    client, milo, temp_dir
):
    body = StreamedBody(2 * MiB, temp_dir)
    response = _post(client, body)
    assert response.status_code == 200
    form = response.context["key_form"]
    assert form.errors["key_file"] == [
        "The file is larger than 64 KiB, more than any SSH public key. Choose the file "
        "that ends in .pub."
    ]
    assert form["label"].value() == "laptop"  # the fields after the file still arrive
    assert body.most_on_disk <= 64 * 1024
    assert _bytes_in(temp_dir) == 0
    assert not SSHKey.objects.exists()


def test_a_file_announcing_its_size_is_dropped_before_any_of_it_is_stored(client, milo, temp_dir):
    body = StreamedBody(2 * MiB, temp_dir, part_length=True)
    response = _post(client, body)
    assert "key_file" in response.context["key_form"].errors
    assert body.most_on_disk == 0


def test_without_a_cap_on_form_fields_a_huge_file_is_still_never_stored(
    client, milo, temp_dir, settings
):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = None
    body = StreamedBody(48 * MiB, temp_dir)
    response = _post(client, body)
    assert "key_file" in response.context["key_form"].errors
    assert body.most_on_disk <= 64 * 1024


def test_the_limit_follows_the_setting(client, milo, temp_dir, settings):
    settings.PORTAL_UPLOAD_MAX_BYTES = 8 * 1024
    response = _post(client, StreamedBody(9 * 1024, temp_dir))
    assert (
        response.context["key_form"]
        .errors["key_file"][0]
        .startswith("The file is larger than 8 KiB")
    )


def test_a_key_file_under_the_limit_is_still_accepted(client, milo, temp_dir):
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("id_ed25519.pub", keydata.ED25519.encode())
    response = client.post(reverse("key_list"), {"key_text": "", "label": "", "key_file": upload})
    assert response.status_code == 302
    assert SSHKey.objects.filter(user=milo).count() == 1

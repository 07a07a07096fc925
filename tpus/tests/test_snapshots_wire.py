"""The workdir snapshot's part of the job scripts' input: the pre-flight's list of
contents after its end, snapshot-place.sh's header and file list; each field checked
before anything is sent."""

from __future__ import annotations

import base64

import pytest

from tpus.remote import jobs as wire

SHA = "a" * 64
OTHER = "b" * 64


def _preflight(**fields) -> wire.Preflight:
    return wire.Preflight(
        user="milo", chips=4, device_glob="/dev/accel*", min_disk_mb=1, min_mem_mb=1, **fields
    )


def test_the_preflight_lists_the_contents_after_its_end():
    data = wire.encode_preflight(_preflight(snapshot_blobs=((SHA, 3), (OTHER, 0))))
    header, _, listing = data.partition(b"end\n")
    assert f"snapshot 2 {len(listing)}".encode() in header
    assert listing == f"{SHA} 3\n{OTHER} 0\n".encode()
    assert wire.encode_preflight(_preflight()).endswith(b"end\n")


@pytest.mark.parametrize("blobs", [(("A" * 64, 1),), ((SHA, -1),), ((SHA, 1), (SHA, 1))])
def test_a_bad_content_is_never_sent_to_the_preflight(blobs):
    with pytest.raises(ValueError):
        wire.encode_preflight(_preflight(snapshot_blobs=blobs))


def test_the_placement_header_counts_what_follows():
    place = wire.Place("milo", "/home/milo/proj", (("src/a b.py", 0o755, SHA),), ((SHA, 5),))
    data = wire.encode_place(place)
    header, _, listing = data.partition(b"end\n")
    assert listing == f"{SHA} 755 {base64.b64encode(b'src/a b.py').decode()}\n".encode()
    assert f"files 1 {len(listing)}".encode() in header
    assert f"blobs 1 {len(f'{SHA} 5') + 1 + 5}".encode() in header
    assert b"dir " + base64.b64encode(b"/home/milo/proj") in header


@pytest.mark.parametrize(
    "path, mode",
    [("../x", 0o644), ("/etc/passwd", 0o644), ("a//b", 0o644), ("a\nb", 0o644), ("a", 0o777)],
)
def test_a_bad_file_is_never_sent_to_the_placement(path, mode):
    with pytest.raises(ValueError):
        wire.encode_place(wire.Place("milo", "/home/milo/p", ((path, mode, SHA),)))


def test_the_missing_answer_is_hashes_only():
    assert wire.parse_missing([SHA, OTHER]) == {SHA, OTHER}
    with pytest.raises(ValueError):
        wire.parse_missing(["../../etc"])

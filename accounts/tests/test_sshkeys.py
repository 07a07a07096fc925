from __future__ import annotations

import base64
import dataclasses
import logging
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accounts.sshkeys import (
    ALLOWED_KEY_TYPES,
    COMMENT_MAX_LENGTH,
    KeyRejected,
    ParsedKey,
    decode_key_file,
    ensure_not_admin_key,
    fingerprint_sha256,
    parse_public_key,
)
from accounts.tests import keydata
from accounts.tests.conftest import GENERATED
from accounts.tests.keydata import ACCEPTED, ED25519, HOSTILE, RSA_2048, SK_ECDSA, SK_ED25519
from accounts.tests.keystore import run_keygen
from accounts.tests.leaks import PUTTY_V3

NEW_KEY_COMMAND = 'ssh-keygen -t ed25519 -C "you@laptop"'


def rejection(text: str) -> KeyRejected:
    with pytest.raises(KeyRejected) as info:
        parse_public_key(text)
    return info.value


# --- keys that are accepted -------------------------------------------------------------


@pytest.mark.parametrize(("text", "key_type", "bits"), ACCEPTED, ids=[a[1] for a in ACCEPTED])
def test_every_allowed_type_is_accepted_with_its_size_and_comment(text, key_type, bits):
    key = parse_public_key(text)

    assert (key.key_type, key.bits) == (key_type, bits)
    assert key.blob_b64 == text.split()[1]
    assert key.comment == text.split(maxsplit=2)[2]
    assert key.fingerprint_sha256 == fingerprint_sha256(keydata.blob_of(text))


def test_the_allowlist_is_exactly_the_documented_one():
    assert {a[1] for a in ACCEPTED} == set(ALLOWED_KEY_TYPES)


@pytest.mark.parametrize(("text", "key_type", "bits"), ACCEPTED, ids=[a[1] for a in ACCEPTED])
def test_fingerprints_match_what_ssh_keygen_prints(text, key_type, bits, keygen_fingerprint):
    assert parse_public_key(text).fingerprint_sha256 == keygen_fingerprint(text)


@pytest.mark.parametrize("name", [f"{t}-{b}" if b else t for t, b in GENERATED])
def test_freshly_generated_keys_match_ssh_keygen_in_fingerprint_and_size(
    name, generated_keys, keygen_fingerprint
):
    path = generated_keys[name]
    bits, fingerprint = run_keygen("-lf", str(path)).split()[:2]

    key = parse_public_key(path.read_text())

    assert key.fingerprint_sha256 == fingerprint
    assert key.bits == int(bits)
    assert key.comment == f"{name}@tests"
    # The line the portal writes is one OpenSSH itself reads as the same key.
    assert keygen_fingerprint(key.authorized_keys_line("tpu-portal:1")) == fingerprint


@pytest.mark.parametrize("text", [SK_ED25519, SK_ECDSA], ids=["sk-ed25519", "sk-ecdsa"])
def test_security_keys_keep_their_original_blob_through_a_round_trip(text):
    key = parse_public_key(text)
    again = parse_public_key(key.authorized_keys_line("tpu-portal:7"))

    assert key.is_security_key
    assert again.key_type == key.key_type
    assert again.blob == keydata.blob_of(text)
    assert again.fingerprint_sha256 == key.fingerprint_sha256


def test_plain_keys_are_not_security_keys():
    assert not parse_public_key(ED25519).is_security_key


@pytest.mark.parametrize(
    "text",
    [
        ED25519 + "\n",
        ED25519 + "\r\n",
        "\n\n  " + ED25519 + "  \n\n",
        "\ufeff" + ED25519,
        ED25519.replace(" ", "\t"),
        ED25519.replace(" ", "   "),
    ],
    ids=["newline", "crlf", "blank-around", "byte-order-mark", "tabs", "several-spaces"],
)
def test_harmless_whitespace_around_and_between_fields_is_forgiven(text):
    key = parse_public_key(text)
    assert key.fingerprint_sha256 == parse_public_key(ED25519).fingerprint_sha256
    assert key.comment == "test-ed25519-256@portal-tests"


def test_a_key_without_comment_has_an_empty_comment():
    assert parse_public_key(" ".join(ED25519.split()[:2])).comment == ""


def test_a_comment_with_accents_is_folded_to_plain_ascii():
    assert parse_public_key(ED25519 + " José Müller").comment.endswith("Jose Muller")


def test_a_comment_in_another_script_is_dropped_rather_than_refused():
    assert parse_public_key(" ".join(ED25519.split()[:2]) + " 王小明").comment == ""


def test_a_long_comment_is_shortened():
    key = parse_public_key(" ".join(ED25519.split()[:2]) + " " + "x" * 500)
    assert key.comment == "x" * COMMENT_MAX_LENGTH


def test_parsed_keys_cannot_be_changed():
    key = parse_public_key(ED25519)
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.key_type = "ssh-rsa"  # type: ignore[misc]


# --- the line the portal writes ---------------------------------------------------------


def test_the_authorized_keys_line_is_type_data_and_the_portal_comment_only():
    key = parse_public_key("  " + ED25519 + " <script>")
    type_, data = ED25519.split()[:2]

    assert key.authorized_keys_line("tpu-portal:milo:3") == f"{type_} {data} tpu-portal:milo:3"
    assert key.authorized_keys_line() == f"{type_} {data}"


@pytest.mark.parametrize(
    "comment", ["two words", "x\ny", "x\rcommand=", 'quote"d', "tab\there", "é", "x" * 101]
)
def test_the_portal_comment_must_be_one_safe_token(comment):
    with pytest.raises(ValueError, match="one token"):
        parse_public_key(ED25519).authorized_keys_line(comment)


# --- refusals ---------------------------------------------------------------------------


def test_the_corpus_of_hostile_inputs_is_large_and_unambiguous():
    assert len(HOSTILE) >= 40
    assert len({bad.id for bad in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize("bad", HOSTILE, ids=[bad.id for bad in HOSTILE])
def test_each_hostile_input_is_refused_with_its_own_code_and_explanation(bad):
    error = rejection(bad.text)

    assert error.code == bad.code, error.message
    assert bad.fragment in error.message
    assert str(error) == error.message
    # Messages never repeat what was pasted (long runs of it, at least).
    for token in re.findall(r"[A-Za-z0-9+/=]{24,}", bad.text):
        assert token not in error.message


@pytest.mark.parametrize(
    "text",
    [keydata.DSA, keydata.RSA_1024, keydata.CERTIFICATE, "ssh-ed448 AAAA"],
    ids=["dsa", "short-rsa", "certificate", "unknown-type"],
)
def test_refusals_for_the_wrong_kind_of_key_say_how_to_make_a_new_one(text):
    assert NEW_KEY_COMMAND in rejection(text).message


def test_a_short_rsa_key_is_told_about_3072_bits_and_ed25519():
    message = rejection(keydata.RSA_1024).message
    assert "3072" in message and "Ed25519" in message


def test_rejections_have_a_readable_repr_with_code_and_message():
    error = rejection("ssh-dss")
    assert repr(error).startswith("KeyRejected(code='dsa', message='DSA")
    assert isinstance(error, ValueError)


# --- pasted private keys ----------------------------------------------------------------

PUTTY_V2 = PUTTY_V3.replace("File-3", "File-2")
PUTTY_BODY_ONLY = PUTTY_V3.split("\n", 1)[1]


@pytest.mark.parametrize(
    ("key_type", "fmt", "passphrase"),
    [
        ("ed25519", "RFC4716", ""),
        ("ed25519", "RFC4716", "correct horse"),
        ("rsa", "PEM", ""),
        ("rsa", "PEM", "correct horse"),
        ("ecdsa", "PEM", ""),
        ("dsa", "PEM", ""),
        ("rsa", "PKCS8", ""),
        ("rsa", "PKCS8", "correct horse"),
    ],
    ids=[
        "openssh",
        "openssh-encrypted",
        "pem-rsa",
        "pem-rsa-encrypted",
        "pem-ec",
        "pem-dsa",
        "pkcs8",
        "pkcs8-encrypted",
    ],
)
@pytest.mark.parametrize(
    "paste",
    [
        lambda key: key,
        lambda key: "   " + key.replace("\n", "\r\n"),
        lambda key: ED25519 + "\n" + key,
    ],
    ids=["as-is", "crlf", "after-a-public-key"],
)
def test_a_pasted_private_key_is_refused_and_never_repeated(
    key_type, fmt, passphrase, paste, make_private_key, caplog
):
    secret = make_private_key(key_type, fmt, passphrase)
    assert_private_key_refused(paste(secret), secret, caplog)


@pytest.mark.parametrize("passphrase", ["", "correct horse"], ids=["plain", "encrypted"])
def test_an_openssh_private_key_pasted_without_its_header_is_still_recognised(
    passphrase, make_private_key, caplog
):
    secret = make_private_key("ed25519", "RFC4716", passphrase)
    body = "\n".join(secret.splitlines()[1:-1])
    assert_private_key_refused(body, secret, caplog)
    assert_private_key_refused("ssh-ed25519 " + body.replace("\n", ""), secret, caplog)


@pytest.mark.parametrize(
    "text", [PUTTY_V3, PUTTY_V2, PUTTY_BODY_ONLY], ids=["v3", "v2", "without-first-line"]
)
def test_a_pasted_putty_private_key_is_refused_and_never_repeated(text, caplog):
    assert_private_key_refused(text, text, caplog)


def assert_private_key_refused(text: str, secret: str, caplog) -> None:
    caplog.set_level(logging.DEBUG)

    error = rejection(text)

    assert error.code == "private_key"
    assert "compromised" in error.message and NEW_KEY_COMMAND in error.message
    assert error.__cause__ is None and error.__context__ is None
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret_line in secret.splitlines():
        fragment = secret_line.strip()
        if len(fragment) < 16 or ":" in fragment or fragment.startswith("-"):
            continue  # headers such as "Encryption: none" are not secret
        assert fragment not in str(error)
        assert fragment not in repr(error)
        assert fragment not in error.message
        assert fragment not in logged


# --- RFC 4716 ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key_type", "bits"), ACCEPTED, ids=[a[1] for a in ACCEPTED])
def test_keys_converted_by_ssh_keygen_to_rfc4716_are_accepted(text, key_type, bits, keygen_rfc4716):
    converted = keygen_rfc4716(text)
    assert converted.startswith("---- BEGIN SSH2 PUBLIC KEY ----")

    key = parse_public_key(converted)

    assert key.key_type == key_type
    assert key.fingerprint_sha256 == parse_public_key(text).fingerprint_sha256
    assert key.comment.startswith(f"{bits}-bit")  # ssh-keygen's own Comment header


def test_an_rfc4716_key_keeps_a_comment_continued_over_lines_and_ignores_other_headers():
    body = ED25519.split()[1]
    text = "\r\n".join(
        [
            "---- BEGIN SSH2 PUBLIC KEY ----",
            "Subject: milo",
            'Comment: "Milo Smith, made on the lab\\',
            ' laptop"',
            "x-private-header: ignored",
            body[:40],
            body[40:],
            "---- END SSH2 PUBLIC KEY ----",
            "",
        ]
    )

    key = parse_public_key(text)

    assert key.comment == "Milo Smith, made on the lab laptop"
    assert key.blob_b64 == body


def test_an_rfc4716_key_without_comment_has_an_empty_comment():
    body = ED25519.split()[1]
    text = f"---- BEGIN SSH2 PUBLIC KEY ----\n{body}\n---- END SSH2 PUBLIC KEY ----"
    assert parse_public_key(text).comment == ""


# --- the portal's own key, uploaded files ----------------------------------------------


def test_the_portal_admin_key_is_refused_by_fingerprint():
    key = parse_public_key(RSA_2048)
    fingerprint = key.fingerprint_sha256

    for given_as in (fingerprint, fingerprint.removeprefix("SHA256:"), fingerprint + "="):
        with pytest.raises(KeyRejected) as info:
            ensure_not_admin_key(key, ["SHA256:somethingelse", given_as])
        assert info.value.code == "admin_key"
        assert "administration key" in info.value.message


def test_other_keys_are_not_mistaken_for_the_admin_key():
    admin = parse_public_key(RSA_2048).fingerprint_sha256
    ensure_not_admin_key(parse_public_key(ED25519), [admin])
    ensure_not_admin_key(parse_public_key(ED25519), [])


@pytest.mark.parametrize(
    "data",
    [
        ED25519.encode(),
        b"\xef\xbb\xbf" + ED25519.encode() + b"\r\n",
        "\ufeff".encode("utf-16-le") + (ED25519 + "\r\n").encode("utf-16-le"),
        (ED25519 + "\n").encode("utf-16"),
    ],
    ids=["utf-8", "utf-8-bom", "utf-16-le-bom", "utf-16-native"],
)
def test_uploaded_files_in_common_encodings_are_read(data):
    key = parse_public_key(decode_key_file(data))
    assert key.comment == "test-ed25519-256@portal-tests"


@pytest.mark.parametrize("data", [b"\x00\x01\xff\xfe\xfd" * 10, b"\x80abc", b"x" * 70_000])
def test_uploaded_files_that_are_not_key_text_are_refused(data):
    with pytest.raises(KeyRejected) as info:
        decode_key_file(data)
    assert info.value.code in {"not_text", "too_long"}


# --- properties -------------------------------------------------------------------------

BOUNDED = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FRAGMENTS = st.sampled_from(
    [
        *ALLOWED_KEY_TYPES,
        "ssh-dss",
        "ssh-ed25519-cert-v01@openssh.com",
        "command=",
        "restrict",
        " ",
        "\t",
        "\n",
        "\r",
        "=",
        "AAAA",
        "AAAAC3NzaC1lZDI1NTE5",
        "---- BEGIN SSH2 PUBLIC KEY ----",
        "---- END SSH2 PUBLIC KEY ----",
        "Comment: ",
        "\\",
        '"',
        "\u00a0",
        "\x00",
        "é",
    ]
)


def parse_or_reject(text: str) -> ParsedKey | None:
    """Whatever happens, it is an accepted key or a KeyRejected, never anything else."""
    try:
        return parse_public_key(text)
    except KeyRejected as error:
        assert error.code and re.fullmatch(r"[a-z0-9_]+", error.code)
        assert error.message
        return None


@BOUNDED
@given(st.text(max_size=400))
def test_arbitrary_text_only_ever_raises_key_rejected(text):
    parse_or_reject(text)


@BOUNDED
@given(st.binary(max_size=400))
def test_arbitrary_bytes_only_ever_raise_key_rejected(data):
    try:
        text = decode_key_file(data)
    except KeyRejected:
        return
    parse_or_reject(text)
    parse_or_reject(data.decode("latin-1"))


@BOUNDED
@given(st.lists(FRAGMENTS | st.text(max_size=8), max_size=12).map("".join))
def test_texts_built_from_key_like_pieces_only_ever_raise_key_rejected(text):
    parse_or_reject(text)


VALID_LINES = st.sampled_from([a[0] for a in ACCEPTED])


@st.composite
def mutated_key(draw) -> str:
    """A valid key, damaged the way copying and tampering damage keys."""
    text = draw(VALID_LINES)
    key_type, data, comment = text.split(maxsplit=2)
    how = draw(st.sampled_from(["flip", "truncate", "insert", "blob-truncate", "blob-extend"]))
    if how == "flip":
        blob = bytearray(base64.b64decode(data))
        bit = draw(st.integers(0, len(blob) * 8 - 1))
        blob[bit // 8] ^= 1 << (bit % 8)
        return f"{key_type} {base64.b64encode(bytes(blob)).decode()} {comment}"
    if how == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if how == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.text(min_size=1, max_size=3)) + text[at:]
    blob = base64.b64decode(data)
    if how == "blob-truncate":
        blob = blob[: draw(st.integers(0, len(blob) - 1))]
    else:
        blob += draw(st.binary(min_size=1, max_size=8))
    return f"{key_type} {base64.b64encode(blob).decode()} {comment}"


@BOUNDED
@given(text=mutated_key())
def test_damaged_keys_are_refused_or_still_agree_with_ssh_keygen(text, keygen_fingerprint):
    key = parse_or_reject(text)
    if key is None:
        return
    assert key.fingerprint_sha256 == keygen_fingerprint(text)
    line = key.authorized_keys_line("tpu-portal:1")
    assert "\n" not in line and "\r" not in line
    assert line.split()[:2] == [key.key_type, key.blob_b64]
    assert parse_public_key(line).fingerprint_sha256 == key.fingerprint_sha256


def test_a_changed_but_still_valid_key_is_a_different_key_to_ssh_keygen_too(keygen_fingerprint):
    blob = bytearray(keydata.blob_of(ED25519))
    blob[-1] ^= 1
    text = keydata.line("ssh-ed25519", bytes(blob))

    key = parse_public_key(text)

    assert key.fingerprint_sha256 == keygen_fingerprint(text)
    assert key.fingerprint_sha256 != parse_public_key(ED25519).fingerprint_sha256
